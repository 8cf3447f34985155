"""Write slipstream/quant/data/calibration_generated.txt: calibration text sampled from
the default model itself (data-free calibration, as in LLM-QAT, Liu et al. 2023).

The hand-written calibration text (calibration.txt, about 1,800 tokens) is too small
for GPTQ: its Hessians are barely full rank for the 1,536-wide down_proj, and GPTQ fits
the directions of that text at the cost of others. No corpus can be downloaded here, so
the larger part of the calibration set is sampled from the model: one chat prompt per
topic below (broad on purpose: prose, science, history, software, mathematics, how-to),
each with its own seed, temperature 0.8, top-p 0.95, a mild repetition penalty. The
prompts are written for this file; none mentions slipstream or the evaluation text.

    PYTHONPATH=. python benchmarks/quant/make_calibration.py [--max-tokens 320]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

TOPICS = [
    "Explain how a hash table works and when it is slower than expected.",
    "Write a short story about a fisherman who finds a bottle with a map inside.",
    "Describe the water cycle for a curious ten-year-old.",
    "What are the main causes of the French Revolution?",
    "Write a Python function that merges two sorted lists, and explain it.",
    "Explain the difference between TCP and UDP with examples.",
    "Give advice to someone learning to play the piano as an adult.",
    "Summarize how vaccines train the immune system.",
    "Write a product description for a waterproof hiking backpack.",
    "Explain what a compiler does, step by step.",
    "Describe a busy market in a coastal town in the early morning.",
    "How do solar panels turn light into electricity?",
    "Write a letter to a friend describing a recent trip to the mountains.",
    "Explain recursion to a beginner programmer with a simple example.",
    "What is the role of the mitochondria in a cell?",
    "Compare renting and buying a home; list the trade-offs.",
    "Write the installation and usage section of a README for a command-line tool that "
    "converts images between formats.",
    "Explain how a database index speeds up queries, and what it costs.",
    "Describe the life of a honeybee colony through the seasons.",
    "What happened during the Apollo 11 mission?",
    "Write a recipe for a vegetable soup with clear numbered steps.",
    "Explain gradient descent and the learning rate.",
    "How does a bicycle stay upright while moving?",
    "Write a poem about autumn rain in a city.",
    "Explain the concept of supply and demand with an everyday example.",
    "Describe how to debug a program that crashes only sometimes.",
    "What is the difference between weather and climate?",
    "Explain how public-key cryptography lets two strangers share a secret.",
    "Write a dialogue between a teacher and a student about fractions.",
    "Describe the architecture of a medieval castle and why it was built that way.",
    "Explain what memory bandwidth is and why it limits some programs.",
    "Give a summary of the plot of a classic adventure novel of your choice.",
    "How do plate tectonics cause earthquakes?",
    "Write unit tests in Python for a function that parses dates, and explain them.",
    "Explain the basics of version control with git: commits, branches and merges.",
    "Describe the rules of chess for someone who has never played.",
    "What is inflation, and how do central banks try to control it?",
    "Explain how the human eye focuses on near and far objects.",
    "Write a short mystery story set on a night train.",
    "Explain Big-O notation with examples of common algorithms.",
    "What are the benefits and risks of remote work for a small company?",
    "Describe how bread rises and why kneading matters.",
    "Explain matrix multiplication and why it is used in neural networks.",
    "Write a speech for the opening of a new public library.",
    "How does a refrigerator move heat out of its inside?",
    "Explain the difference between a process and a thread in an operating system.",
    "Describe the migration of birds and how they find their way.",
    "Write an email to a customer explaining a delayed delivery.",
    "Explain what an API is with an example from a weather service.",
    "What were the main achievements of the Roman Empire?",
    "Explain how caching works in a web browser.",
    "Describe a walk through a rainforest, with its sounds and smells.",
    "Explain probability with dice and coins, including expected value.",
    "Write a configuration guide for a small home network with a router and a printer.",
    "How do electric cars differ from petrol cars in how they work?",
    "Explain the idea of a function in mathematics and in programming.",
    "Write a short biography of a famous scientist of your choice.",
    "Explain how floating-point numbers are stored and why 0.1 + 0.2 is not 0.3.",
    "Describe how to plant and care for tomatoes in a garden.",
    "Explain what a neural network layer computes, in plain words.",
    "Write a fairy tale about a clever fox and a proud king.",
    "Explain sorting algorithms: bubble sort, merge sort and quicksort.",
    "What causes the seasons on Earth?",
    "Explain how to write clear documentation for a software project.",
    "Describe the history and uses of the printing press.",
    "Explain how GPUs differ from CPUs and what they are good at.",
    "Write a travel guide paragraph about a quiet island village.",
    "Explain the stages of sleep and why sleep matters.",
    "How do you design a REST API for a to-do list application?",
    "Explain photosynthesis and why plants are green.",
    "Write a review of an imaginary science-fiction film.",
    "Explain what a linked list is and implement one in Python.",
    "Describe the causes and effects of ocean tides.",
    "Explain the basics of personal budgeting.",
    "Explain how a search engine finds and ranks web pages.",
    "Write a short scene in which two old friends meet after twenty years.",
    "Explain what statistics can and cannot tell us, with examples of common mistakes.",
    "Describe how a violin produces sound.",
    "Explain concurrency problems like race conditions and deadlocks.",
    "Explain the scientific method using an experiment with plants.",
    "Write instructions for changing a flat tire on a car.",
    "Explain how JSON is used to exchange data between programs, with an example.",
    "Describe the daily life of a lighthouse keeper a century ago.",
    "Explain how compression algorithms make files smaller.",
    "What are black holes and how do astronomers detect them?",
    "Write a shell script that backs up a folder and explain each line.",
    "Explain the difference between machine learning training and inference.",
    "Describe the history of the bicycle.",
    "Explain how a loan's interest is calculated.",
    "Write a persuasive paragraph on why cities should plant more trees.",
    "Explain how a queue and a stack differ, with real-world examples.",
    "Describe volcanoes: how they form and why some explode.",
    "Explain how to profile a slow program and find the bottleneck.",
    "Write a short story about a robot that learns to paint.",
    "Explain what an operating system kernel is responsible for.",
    "Describe the main ideas of the theory of evolution.",
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=320)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[2] /
                                         "slipstream/quant/data/calibration_generated.txt"))
    args = ap.parse_args(argv)
    from slipstream import LLM, SamplingParams
    from slipstream.loader import default_model_path
    llm = LLM(str(default_model_path()), device="cpu", enable_prefix_caching=False)
    params = [SamplingParams(temperature=0.8, top_p=0.95, repetition_penalty=1.1,
                             max_tokens=args.max_tokens, seed=1000 + i)
              for i in range(len(TOPICS))]
    outs = llm.chat([[{"role": "user", "content": t}] for t in TOPICS], params, use_tqdm=False)
    texts = [o.outputs[0].text.strip() for o in outs]
    Path(args.out).write_text("\n\n".join(t for t in texts if t) + "\n", encoding="utf-8")
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"wrote {args.out}: {len(texts)} samples, {n} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())

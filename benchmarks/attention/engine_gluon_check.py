"""The Gluon prefill kernel inside the engine: the same prompts through
`LLM.generate` with SLIPSTREAM_GLUON_PREFILL=0 and =1, each in its own process.

    python benchmarks/attention/engine_gluon_check.py --out DIR [--model llama-3-8b]
    python benchmarks/attention/engine_gluon_check.py --out /tmp/x --smoke   # CPU: path only
    ... --budget 2048: prompts in chunks of 2,048 tokens (the later chunks: the paged kernel)

Checks the first sampled token and its logprob (right after the prefill) and
the greedy continuation of each prompt, then times whole-prompt prefill
(`max_tokens=1`) of 4 x 4k and 2 x 8k random prompts, median of 3, in
prompt tokens per second. Random bf16 weights (seeded, identical in both
processes). Writes DIR/engine_gluon.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHAPES = {"4x4k": (4, 4096), "2x8k": (2, 8000)}   # the 8B preset holds 8,192 positions


def worker(model: str, smoke: bool, budget: int | None = None) -> dict:
    import torch
    from slipstream import LLM, SamplingParams
    shapes = {"4x64": (4, 64)} if smoke else SHAPES
    longest = max(n for _, n in shapes.values())
    llm = LLM(None if smoke else model, load_format="auto" if smoke else "dummy", dtype="bfloat16" if not smoke else "float32",
              max_model_len=longest + 64 if smoke else 8192,
              max_num_batched_tokens=budget or max(longest, 16384),
              max_num_seqs=8, seed=0, enable_prefix_caching=False, device="cuda" if torch.cuda.is_available() else "cpu")
    vocab = llm.engine.config.model_config.vocab_size
    g = torch.Generator().manual_seed(1)
    res = {"gluon": os.environ.get("SLIPSTREAM_GLUON_PREFILL", "0"), "shapes": {}}
    for name, (b, n) in shapes.items():
        prompts = [{"prompt_token_ids": torch.randint(0, vocab, (n,), generator=g).tolist()}
                   for _ in range(b)]
        outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, logprobs=1,
                                                   ignore_eos=True), use_tqdm=False)
        first = []
        for o in outs:
            c = o.outputs[0]
            lp = c.logprobs[0] if c.logprobs else None
            tok = c.token_ids[0]
            val = None
            if lp is not None:
                entry = lp.get(tok) if isinstance(lp, dict) else None
                val = getattr(entry, "logprob", entry)
            first.append({"token": tok, "logprob": val, "tokens": c.token_ids})
        times = []
        for _ in range(1 if smoke else 3):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            llm.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        t = statistics.median(times)
        res["shapes"][name] = {"first": first, "prefill_s": t, "prompt_tok_s": b * n / t}
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("benchmarks/attention/results"))
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--budget", type=int, default=None,
                    help="max_num_batched_tokens: below the prompt length, prompts run in chunks, "
                         "each after the cached context of the ones before (the paged kernel)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print("RESULT " + json.dumps(worker(a.model, a.smoke, a.budget)), flush=True)
        return 0
    a.out.mkdir(parents=True, exist_ok=True)
    runs = {}
    for flag in ("0", "1"):
        env = dict(os.environ, SLIPSTREAM_GLUON_PREFILL=flag,
                   PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        cmd = [sys.executable, __file__, "--worker", "--model", a.model] + (["--smoke"] if a.smoke else []) \
            + (["--budget", str(a.budget)] if a.budget else [])
        p = subprocess.run(cmd, env=env, capture_output=True, text=True)
        line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
        if p.returncode or not line:
            runs[flag] = {"error": p.stderr[-3000:]}
            print(f"gluon={flag}: exit {p.returncode}\n{p.stderr[-3000:]}", file=sys.stderr)
            continue
        runs[flag] = json.loads(line[0][7:])
    rows = ["| prompts | Triton tok/s | Gluon tok/s | Gluon / Triton | first token equal | "
            "max first-logprob diff | greedy tokens equal |", "| --- | ---: | ---: | ---: | --- | ---: | --- |"]
    if "error" not in runs["0"] and "error" not in runs["1"]:
        for name in runs["0"]["shapes"]:
            t, g = runs["0"]["shapes"][name], runs["1"]["shapes"][name]
            eq = sum(x["token"] == y["token"] for x, y in zip(t["first"], g["first"]))
            diffs = [abs(x["logprob"] - y["logprob"]) for x, y in zip(t["first"], g["first"])
                     if x["logprob"] is not None and y["logprob"] is not None and x["token"] == y["token"]]
            same = sum(x["tokens"] == y["tokens"] for x, y in zip(t["first"], g["first"]))
            rows.append(f"| {name} | {t['prompt_tok_s']:,.0f} | {g['prompt_tok_s']:,.0f} | "
                        f"{g['prompt_tok_s'] / t['prompt_tok_s']:.3f} | {eq}/{len(t['first'])} | "
                        f"{max(diffs) if diffs else float('nan'):.2e} | {same}/{len(t['first'])} |")
    budget = f", chunks of {a.budget} tokens" if a.budget else ""
    md = "\n".join(["# Gluon prefill through the engine", "", f"model {a.model}, random weights{budget}", ""]
                   + rows)
    (a.out / "engine_gluon.json").write_text(json.dumps(runs, indent=1))
    (a.out / "engine_gluon.md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The baseline of `slipstream bench serve`: the same requests (same seed, same length laws and
limits) run offline through `LLM.generate` in one batch, with no HTTP, no streaming and no
arrival process. Its token throughput is what the engine alone does; the server's at rate
`inf` should come close, and the gap is the serving overhead.

    python benchmarks/serving/offline_baseline.py --num-requests 64 --max-input-len 512 \
        --max-output-len 128 [--model M --load-format dummy --dtype bfloat16] --out DIR
"""
from __future__ import annotations

import argparse
import json
import os
import time

from slipstream.bench.serve import make_samples


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--load-format", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--max-input-len", type=int, default=1024)
    p.add_argument("--max-output-len", type=int, default=512)
    p.add_argument("--min-len", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/serving/results")
    p.add_argument("--label", default="offline")
    args = p.parse_args()

    from slipstream import LLM, SamplingParams
    opts = dict(dtype=args.dtype, device=args.device, max_num_seqs=args.max_num_seqs)
    if args.load_format:
        opts["load_format"] = args.load_format
    t0 = time.perf_counter()
    llm = LLM(args.model, **opts)
    load_s = time.perf_counter() - t0
    engine = llm.engine
    vocab = engine.config.model_config.vocab_size
    max_in = min(args.max_input_len, engine.max_model_len - args.max_output_len)
    samples = make_samples(args.num_requests, vocab, max_in, args.max_output_len, args.min_len,
                           args.seed)
    prompts = [{"prompt_token_ids": s.prompt_ids} for s in samples]
    params = [SamplingParams(max_tokens=s.output_len, ignore_eos=True, temperature=0.0)
              for s in samples]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert out_tokens == sum(s.output_len for s in samples), "a request stopped early"
    in_tokens = sum(len(s.prompt_ids) for s in samples)
    result = {"label": args.label, "model": engine.config.model, "device": str(engine.config.device),
              "num_requests": len(samples), "load_s": load_s, "duration_s": wall,
              "request_throughput": len(samples) / wall,
              "output_token_throughput": out_tokens / wall,
              "total_token_throughput": (in_tokens + out_tokens) / wall,
              "mean_input_tokens": in_tokens / len(samples),
              "mean_output_tokens": out_tokens / len(samples),
              "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "args": vars(args)}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{args.label}.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "args"}, indent=1))


if __name__ == "__main__":
    main()

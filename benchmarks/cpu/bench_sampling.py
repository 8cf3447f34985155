"""Decode with the CLI's default sampling (temperature 0.7, top-p 0.9) on the CPU, default
model: top-p over the likeliest candidates (`sampler.nucleus_candidates`: the C kernels'
tokens near the row's largest logit, or torch's topk of 256) against the sort of the
whole vocabulary, alternating in one process, greedy decoding beside them.

    python benchmarks/cpu/bench_sampling.py --out benchmarks/cpu/results
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    import torch
    from slipstream import LLM, SamplingParams
    from slipstream.layers import sampler
    llm = LLM()
    prompt = "Write a long story about a dragon."
    top_p = SamplingParams(temperature=0.7, top_p=0.9, seed=0, max_tokens=args.tokens, ignore_eos=True)
    runs = {"greedy": ("c", SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)),
            "top-p, C candidates": ("c", top_p),
            "top-p, topk candidates": ("topk", top_p),
            "top-p, full sort": ("sort", top_p)}
    c_candidates = sampler._c_candidates
    llm.generate([prompt], runs["greedy"][1], use_tqdm=False)
    times = {k: [] for k in runs}
    load = os.getloadavg()[0]
    for _ in range(args.reps):
        for name, (mode, params) in runs.items():
            sampler.CPU_NUCLEUS = mode != "sort"
            sampler._c_candidates = c_candidates if mode == "c" else (lambda logits: None)
            t = time.perf_counter()
            llm.generate([prompt], params, use_tqdm=False)
            times[name].append(time.perf_counter() - t)
    sampler._c_candidates = c_candidates
    sampler.CPU_NUCLEUS = True
    rows = [{"run": k, "tok_s": round(args.tokens / statistics.median(v), 1)} for k, v in times.items()]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip() or "unknown"
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__, "commit": commit, "tokens": args.tokens,
            "load_before": round(load, 2), "load_after": round(os.getloadavg()[0], 2)}
    md = "\n".join([f"# CPU decode by sampling ({meta['date']}, commit {commit})", "",
                    f"Default model, one request, {args.tokens} tokens (prefill included), medians of "
                    f"{args.reps} alternating runs; torch {meta['torch']}; load average "
                    f"{meta['load_before']} -> {meta['load_after']}.", "",
                    "| run | tok/s |", "| --- | ---: |"] + [f"| {r['run']} | {r['tok_s']} |" for r in rows]) + "\n"
    print(md)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"sampling_{meta['date'][:10]}_{commit}.md").write_text(md)
        (out / f"sampling_{meta['date'][:10]}_{commit}.json").write_text(
            json.dumps({"meta": meta, "results": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

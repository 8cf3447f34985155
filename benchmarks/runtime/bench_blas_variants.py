"""cuBLAS settings that must be chosen before cuBLAS starts, compared fairly:
each variant in its own process, the variants alternating over repeats, so a
drift of the machine (clocks, the copy bandwidth a process measures) hits
every variant alike. Llama-3-8B shape, random bf16 weights, the `latency`
stage of bench_engine.py (decode at the given batches, 128-token prompts,
128 outputs; prefill of the batch's prompts).

    python benchmarks/runtime/bench_blas_variants.py --out DIR [--repeats 3] [--batches 1,8,64]

Variants:
  default      torch's defaults (cuBLAS, its default workspace: cuBLASLt may pick
               split-K kernels and a splitKreduce kernel after them)
  no-workspace CUBLAS_WORKSPACE_CONFIG=:0:0 and CUBLASLT_WORKSPACE_SIZE=0 (no split-K;
               what the engine sets on CUDA since runner/blas.py)
  cublaslt     torch.backends.cuda.preferred_blas_library("cublaslt"), torch's workspace

Writes DIR/<variant>_<repeat>/latency.json and DIR/summary.{json,md}: per
variant and batch, the median decode tokens/s, step over the roofline step,
% of the copy bandwidth each process measured, and prefill tokens/s.
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

HERE = Path(__file__).resolve().parent
VARIANTS = {
    "default": {"SLIPSTREAM_CUBLAS_WORKSPACE": "torch"},
    "no-workspace": {"CUBLAS_WORKSPACE_CONFIG": ":0:0", "CUBLASLT_WORKSPACE_SIZE": "0"},
    "cublaslt": {"BENCH_BLAS": "cublaslt", "SLIPSTREAM_CUBLAS_WORKSPACE": "torch"},
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    a = ap.parse_args()
    out = Path(a.out)
    names = a.variants.split(",")
    runs = {n: [] for n in names}
    t0 = time.perf_counter()
    for rep in range(a.repeats):
        for name in (names if rep % 2 == 0 else names[::-1]):
            d = out / f"{name}_{rep}"
            d.mkdir(parents=True, exist_ok=True)
            env = dict(os.environ, BENCH_BATCHES=a.batches, **VARIANTS[name])
            rc = subprocess.call([sys.executable, str(HERE / "bench_engine.py"), "--out", str(d),
                                  "--stages", "latency"], env=env)
            path = d / "latency.json"
            if rc == 0 and path.exists():
                runs[name].append(json.loads(path.read_text()))
            print(f"== {name} repeat {rep}: exit {rc} ({time.perf_counter() - t0:.0f} s)", flush=True)
    summary = {}
    for name, results in runs.items():
        rows = {}
        for b in map(int, a.batches.split(",")):
            got = [r for res in results for r in res["rows"] if r["batch_size"] == b]
            if not got:
                continue
            med = lambda k: statistics.median(r[k] for r in got)   # noqa: E731
            rows[b] = {"decode_tokens_per_s": med("decode_tokens_per_s"),
                       "all_decode_tokens_per_s": [round(r["decode_tokens_per_s"], 1) for r in got],
                       "step_over_roofline": med("step_over_roofline"),
                       "pct_copy_bandwidth": med("decode_pct_copy_bandwidth"),
                       "prefill_tokens_per_s": med("prefill_tokens_per_s")}
        summary[name] = {"copy_bandwidth_GBps": [round(r["copy_bandwidth_GBps"]) for r in results],
                         "batches": rows}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    lines = ["| variant | batch | decode tok/s (median; each process) | step / roofline | % copy BW "
             "| prefill tok/s | x default |", "| --- | ---: | --- | ---: | ---: | ---: | ---: |"]
    base = summary.get("default", {}).get("batches", {})
    for name, s in summary.items():
        for b, r in s["batches"].items():
            ratio = (f"{r['decode_tokens_per_s'] / base[b]['decode_tokens_per_s']:.3f}"
                     if b in base else "")
            each = ", ".join(map(str, r["all_decode_tokens_per_s"]))
            lines.append(f"| {name} | {b} | {r['decode_tokens_per_s']:,.1f} ({each}) "
                         f"| {r['step_over_roofline']:.3f} | {r['pct_copy_bandwidth']:.1f}% "
                         f"| {r['prefill_tokens_per_s']:,.0f} | {ratio} |")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

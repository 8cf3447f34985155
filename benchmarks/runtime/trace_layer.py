"""Kernel timeline of one decode layer's chain at batch 1 (bench_tma_gemv.py's layer
variants), from the profiler: each kernel's start and end relative to the layer's
first kernel, so gaps and overlaps between chained kernels show.

    python benchmarks/runtime/trace_layer.py --out DIR     # H100/H200
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE)]


def timeline(torch, calls, repeats=3):
    """Kernels of `repeats` eager rounds of `calls` (one call = one layer), last round."""
    from torch.profiler import ProfilerActivity, profile
    for c in calls:
        c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            graph.replay()
        torch.cuda.synchronize()
    ev = sorted((e for e in prof.events() if e.device_type.name == "CUDA"),
                key=lambda e: e.time_range.start)
    per_round = len(ev) // repeats
    last = ev[-per_round:]
    t0 = last[0].time_range.start
    return [{"name": e.name[:60], "start": e.time_range.start - t0, "end": e.time_range.end - t0}
            for e in last]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    import torch
    import bench_tma_gemv as B
    captured = {}

    def fake_timer(calls):
        captured.setdefault("calls", []).append(calls)
        return 0.0
    B.layer(torch, None, "cuda", fake_timer, {})
    names = ["engine", "gemv_norm_kernels", "folded", "folded_cublas_gate_up", "folded_silu", "attention"]
    out = {}
    for name, calls in zip(names, captured["calls"]):
        if name in ("engine", "folded_silu"):
            out[name] = timeline(torch, calls)
            print(f"== {name}")
            for k in out[name]:
                print(f"  {k['start']:8.1f} {k['end']:8.1f} {k['end'] - k['start']:7.1f}  {k['name']}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "trace_layer.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

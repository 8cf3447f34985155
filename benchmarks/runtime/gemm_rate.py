"""How fast cuBLAS runs the Llama-3-8B linear layers at each row count (the
tokens of a step), against the bandwidth and matmul-rate ceilings measured in
the same process. The throughput benchmark's roofline assumes every GEMM runs at
the 8192^3 matmul rate; this says how far the step's real shapes are from it.

    python benchmarks/runtime/gemm_rate.py [--out FILE.json] [--rows 1,64,...]

Each shape is timed as the 32 layers' GEMMs would run (32 weight copies, so the
weights stream from HBM), in one CUDA graph, median of several replays; then
the whole layer stack (all four shapes x 32) at a few row counts, replayed
back to back for about a second, for the sustained rate under load.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.cuda_timing import graph_timer  # noqa: E402

# (name, out features, in features): Llama-3-8B, QKV and gate/up concatenated.
SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
LAYERS = 32


def sweep(rows: list[int], bw: float, peak: float) -> list[dict]:
    out = []
    for name, n, k in SHAPES:
        ws = [torch.empty(n, k, device="cuda", dtype=torch.bfloat16).uniform_(-0.03, 0.03)
              for _ in range(LAYERS)]
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            calls = [lambda w=w: torch.mm(x, w.t(), out=y) for w in ws]
            ms = graph_timer(calls, min_calls=LAYERS, replays=7)()
            flops, nbytes = 2 * m * n * k, 2 * (n * k + m * k + m * n)
            bound = max(nbytes / bw, flops / peak)
            out.append({"shape": name, "n": n, "k": k, "rows": m, "us": ms * 1e3,
                        "TFLOPs": flops / ms / 1e9, "TBps": nbytes / ms / 1e9,
                        "of_bound": bound / (ms / 1e3)})
            print(f"{name:8s} m={m:5d} {ms * 1e3:8.1f} us {flops / ms / 1e9:7.1f} TFLOP/s "
                  f"{nbytes / ms / 1e9:6.2f} TB/s  {100 * bound / (ms / 1e3):5.1f}% of bound", flush=True)
        del ws
        torch.cuda.empty_cache()
    return out


def sustained(rows: list[int], peak: float, seconds: float = 1.0) -> list[dict]:
    """All four shapes x 32 layers in one graph, replayed back to back."""
    res = []
    ws = [[torch.empty(n, k, device="cuda", dtype=torch.bfloat16).uniform_(-0.03, 0.03)
           for _ in range(LAYERS)] for _, n, k in SHAPES]
    for m in rows:
        xs = {k: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _, _, k in SHAPES}
        ys = {n: torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _, n, _ in SHAPES}
        calls = [lambda w=w, k=k, n=n: torch.mm(xs[k], w.t(), out=ys[n])
                 for (_, n, k), wl in zip(SHAPES, ws) for w in wl]
        timer = graph_timer(calls, min_calls=len(calls), replays=3)
        ms_one = timer()
        reps = max(3, int(seconds / (ms_one * len(calls) / 1e3)))
        t_all = [timer() for _ in range(reps // 3)]
        ms = sorted(t_all)[len(t_all) // 2]
        flops = sum(2 * m * n * k for _, n, k in SHAPES) * LAYERS
        per_step = ms * len(calls)
        res.append({"rows": m, "step_ms": per_step, "TFLOPs": flops / per_step / 1e9,
                    "of_peak": flops / per_step / 1e9 / (peak / 1e12), "first_ms": ms_one * len(calls)})
        print(f"32 layers m={m:5d}: {per_step:7.2f} ms, {flops / per_step / 1e9:6.1f} TFLOP/s "
              f"({100 * flops / per_step / 1e9 / (peak / 1e12):.0f}% of the 8192^3 rate), sustained "
              f"{reps // 3} x 3 replays", flush=True)
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--rows", default="1,8,64,128,256,512,768,1024,1536,2048,4096,8192")
    ap.add_argument("--sustained-rows", default="512,1024,2048,8192")
    a = ap.parse_args()
    from slipstream.analysis.hardware import measure_copy_bandwidth, measure_matmul_rate
    dev = torch.device("cuda")
    bw, peak = measure_copy_bandwidth(dev), measure_matmul_rate(dev, torch.bfloat16)
    print(f"copy {bw / 1e9:.0f} GB/s, bf16 8192^3 {peak / 1e12:.0f} TFLOP/s", flush=True)
    res = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "copy_GBps": bw / 1e9, "matmul_TFLOPs": peak / 1e12,
           "sweep": sweep([int(r) for r in a.rows.split(",")], bw, peak),
           "sustained": sustained([int(r) for r in a.sustained_rows.split(",")], peak)}
    res["matmul_TFLOPs_after"] = measure_matmul_rate(dev, torch.bfloat16) / 1e12
    print(f"bf16 8192^3 after: {res['matmul_TFLOPs_after']:.0f} TFLOP/s")
    if a.out:
        a.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

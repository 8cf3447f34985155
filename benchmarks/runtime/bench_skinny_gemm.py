"""The few-row tensor-core GEMM (kernels/skinny_gemm.py) against cuBLAS (F.linear).

    python benchmarks/runtime/bench_skinny_gemm.py --out DIR          # H100/H200, ~2 minutes
    python benchmarks/runtime/bench_skinny_gemm.py --smoke --out DIR  # CPU interpreter, one shape

bf16 weights of SmolLM2-135M (the EAGLE loop's tree verification: ~61 rows) and of
Llama-3-8B (decode batches of 8-64). Each product is timed in one CUDA graph over
enough weight copies to stream from HBM (more bytes than L2 holds), median us per
call; every config of the sweep is checked against F.linear first. Reported per
(shape, rows): cuBLAS, the best config and its speedup, and both as % of the
copy bandwidth measured in the same run (weight bytes only).
Writes DIR/skinny_gemm.json and DIR/skinny_gemm.md.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT), str(HERE.parent)]

SHAPES = {  # name: (N, K)
    "smol qkv": (960, 576), "smol o": (576, 576), "smol gate_up": (3072, 576),
    "smol down": (576, 1536),
    "8B qkv": (6144, 4096), "8B o": (4096, 4096), "8B gate_up": (28672, 4096),
    "8B down": (4096, 14336)}
ROWS = {"smol": (16, 32, 61), "8B": (8, 16, 32, 64)}
CONFIGS = [{"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w, "num_stages": s}
           for bn in (16, 32, 64) for bk in (64, 128) for s in (3, 5) for w in (4,)]
CONFIGS += [{"BLOCK_N": 16, "BLOCK_K": 128, "num_warps": 2, "num_stages": 4},
            {"BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 4, "num_stages": 3}]
L2_BYTES = 128 << 20


def name_of(c: dict) -> str:
    return f"N{c['BLOCK_N']}K{c['BLOCK_K']}w{c['num_warps']}s{c['num_stages']}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    import torch
    import torch.nn.functional as F
    import triton
    from slipstream.kernels.skinny_gemm import skinny_gemm
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "torch": torch.__version__, "triton": triton.__version__}
    if args.smoke:
        x = torch.randn(61, 64).bfloat16()
        w = torch.randn(48, 64).bfloat16()
        err = (skinny_gemm(x, w).float() - F.linear(x.float(), w.float())).abs().max().item()
        (out / "skinny_gemm.json").write_text(json.dumps({"env": env, "smoke_max_err": err}))
        print(f"smoke: max error {err:.3g}")
        return
    from cuda_timing import graph_timer
    from slipstream.analysis.hardware import measure_copy_bandwidth
    dev = torch.device("cuda")
    env["device"] = torch.cuda.get_device_name(dev)
    copy_bw = measure_copy_bandwidth(dev)
    env["copy_GBps"] = copy_bw / 1e9
    print(f"{env}", flush=True)
    rows_out = []
    for shape, (n, k) in SHAPES.items():
        nbytes = n * k * 2
        copies = max(2, math.ceil(L2_BYTES / nbytes))
        ws = [torch.randn(n, k, device=dev).bfloat16() / k ** 0.5 for _ in range(copies)]
        for m in ROWS[shape.split()[0]]:
            x = torch.randn(m, k, device=dev).bfloat16()
            y = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
            want = F.linear(x.float(), ws[0].float())
            row = {"shape": shape, "N": n, "K": k, "rows": m, "us": {}}
            row["us"]["cublas"] = 1e3 * graph_timer(
                [lambda w=w: torch.mm(x, w.t(), out=y) for w in ws])()
            for c in CONFIGS:
                got = skinny_gemm(x, ws[0], config=c).float()
                err = ((got - want).abs().max() / want.abs().max()).item()
                if err > 1e-2:
                    row["us"][name_of(c)] = None
                    print(f"  {shape} m={m} {name_of(c)}: WRONG rel err {err:.3g}", flush=True)
                    continue
                row["us"][name_of(c)] = 1e3 * graph_timer(
                    [lambda w=w: skinny_gemm(x, w, out=y, config=c) for w in ws])()
            best = min((v, kname) for kname, v in row["us"].items()
                       if kname != "cublas" and v is not None)
            row["best"], row["best_us"] = best[1], best[0]
            row["speedup"] = row["us"]["cublas"] / best[0]
            row["cublas_pct_bw"] = 100 * nbytes / (row["us"]["cublas"] * 1e-6) / copy_bw
            row["best_pct_bw"] = 100 * nbytes / (best[0] * 1e-6) / copy_bw
            rows_out.append(row)
            print(f"{shape:13s} m={m:3d} cuBLAS {row['us']['cublas']:7.2f} us "
                  f"({row['cublas_pct_bw']:.0f}%)  best {best[1]} {best[0]:7.2f} us "
                  f"({row['best_pct_bw']:.0f}%)  {row['speedup']:.2f}x", flush=True)
        del ws
    (out / "skinny_gemm.json").write_text(json.dumps({"env": env, "rows": rows_out}, indent=1))
    lines = [f"# Few-row GEMM against cuBLAS ({env['device']}, {env['date']})", "",
             f"torch {env['torch']}, triton {env['triton']}, copy bandwidth "
             f"{env['copy_GBps']:.0f} GB/s (weight bytes only in the % columns).", "",
             "| weight (N x K) | rows | cuBLAS us | best config | its us | speedup |",
             "| --- | ---: | ---: | --- | ---: | ---: |"]
    for r in rows_out:
        lines.append(f"| {r['shape']} {r['N']} x {r['K']} | {r['rows']} | "
                     f"{r['us']['cublas']:.2f} ({r['cublas_pct_bw']:.0f}%) | {r['best']} | "
                     f"{r['best_us']:.2f} ({r['best_pct_bw']:.0f}%) | {r['speedup']:.2f}x |")
    (out / "skinny_gemm.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

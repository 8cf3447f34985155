"""The batch-1 8-bit TMA GEMV (kernels/tma_int8_gemv.py) against the engine's w8a16 GEMV and
bf16 cuBLAS, on one H100/H200.

    python benchmarks/quant/bench_tma_int8_gemv.py --out DIR [--commit SHA]

Llama-3-8B weights, per-channel int8 codes in the engine's tiled word layout. First the
checks (symmetric and asymmetric codes against the dequantized product in fp32, the
engine's GEMV on the same words), then the copy bandwidth, then us per call for bf16
cuBLAS (F.linear on a bf16 weight of the shape), the engine's GEMV
(kernels/int_weight_gemv.py, its default launch) and the TMA GEMV in several launches;
each in one CUDA graph over enough weight copies that they stream from HBM.
Writes DIR/tma_int8_gemv.json and .md.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}
# (BLOCK_N, STAGES, warps, programs a SM: 0 = one a row block)
CONFIGS = {"N16s8": (16, 8, 4, 0), "N32s6": (32, 6, 4, 0), "N32s8": (32, 8, 4, 0),
           "N64s4w8": (64, 4, 8, 0), "N16s12": (16, 12, 4, 0), "N32s6p2": (32, 6, 4, 2)}


def cfg(name):
    bn, st, w, p = CONFIGS[name]
    return {"BLOCK_N": bn, "STAGES": st, "num_warps": w, "PROGRAMS": p}


def layer(torch, n, k, gen, sym=True):
    from slipstream.kernels.int_weight_gemv import tile_codes
    codes = torch.randint(0, 256, (n, k), device="cuda", generator=gen, dtype=torch.int32).to(torch.uint8)
    scales = torch.rand(n, 1, device="cuda", generator=gen) * 1e-3 + 1e-4
    zeros = None if sym else torch.randint(100, 156, (n, 1), device="cuda", generator=gen,
                                           dtype=torch.int32).to(torch.uint8)
    return codes, tile_codes(codes, 8, 128), scales, zeros


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/quant/results")
    ap.add_argument("--commit", default="unknown")
    args = ap.parse_args()
    import torch
    import torch.nn.functional as F
    import triton
    from benchmarks.cuda_timing import graph_timer
    from slipstream.analysis.hardware import measure_copy_bandwidth
    from slipstream.kernels.int_weight_gemv import int_weight_gemv
    from slipstream.kernels.tma_int8_gemv import tma_int8_gemv
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        sys.exit("needs an sm_90 GPU (H100/H200)")
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    gen = torch.Generator(device="cuda").manual_seed(0)
    res = {"meta": {"device": torch.cuda.get_device_name(),
                    "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "torch": torch.__version__, "triton": triton.__version__, "commit": args.commit},
           "checks": {}}
    for name, (n, k) in SHAPES.items():
        for sym in (True, False):
            codes, words, scales, zeros = layer(torch, n, k, gen, sym)
            x = torch.randn(1, k, device="cuda", generator=gen).bfloat16()
            z = 128.0 if zeros is None else zeros.float()
            want = F.linear(x.float(), (codes.float() - z) * scales)
            scale = want.abs().max().item()
            for c in (CONFIGS if sym else ["N16s8"]):
                got = tma_int8_gemv(x, words, scales, zeros, config=cfg(c), chain=c == "N16s8")
                e = (got.float() - want).abs().max().item() / scale
                res["checks"][f"{name}_{'sym' if sym else 'asym'}_{c}"] = {"rel_err": e, "ok": e < 1e-2}
            eng = int_weight_gemv(x, words, scales, zeros, 8, k, 128)
            e = (eng.float() - want).abs().max().item() / scale
            res["checks"][f"{name}_{'sym' if sym else 'asym'}_engine_gemv"] = {"rel_err": e, "ok": e < 1e-2}
    bad = {k: v for k, v in res["checks"].items() if not v["ok"]}
    print(f"checks: {len(res['checks'])}, failed: {bad or 'none'} [{time.time() - t0:.0f}s]", flush=True)
    bw = measure_copy_bandwidth("cuda")
    res["copy_GBps"] = bw / 1e9
    rows = []
    for name, (n, k) in SHAPES.items():
        copies = max(2, min(16, math.ceil(512e6 / (n * k))))
        layers = [layer(torch, n, k, gen) for _ in range(copies)]
        xs = [torch.randn(1, k, device="cuda", generator=gen).bfloat16() for _ in range(copies)]
        ws = [(torch.randn(n, k, device="cuda", generator=gen) * 0.02).bfloat16() for _ in range(min(copies, 8))]
        row = {"name": name, "n": n, "k": k, "us": {}}
        timer = lambda calls: graph_timer(calls, min_calls=64, replays=10)() * 1e3  # noqa: E731
        row["us"]["bf16_cublas"] = timer([lambda x=x, w=w: F.linear(x, w) for x, w in zip(xs, ws)])
        row["us"]["engine_gemv"] = timer([lambda x=x, L=L: int_weight_gemv(x, L[1], L[2], None, 8, k, 128)
                                          for x, L in zip(xs, layers)])
        for c in CONFIGS:
            row["us"][c] = timer([lambda x=x, L=L, c=c: tma_int8_gemv(x, L[1], L[2], None, config=cfg(c))
                                  for x, L in zip(xs, layers)])
        best = min(CONFIGS, key=row["us"].get)
        row["best"] = best
        row["pct_copy_bw"] = {key: 100 * n * k / (v * 1e-6) / bw for key, v in row["us"].items()}
        row["pct_copy_bw"]["bf16_cublas"] *= 2
        rows.append(row)
        print(f"  {name}: " + ", ".join(f"{key} {v:.1f}" for key, v in row["us"].items()), flush=True)
        del layers, xs, ws
    res["rows"] = rows
    lines = [f"# 8-bit TMA GEMV, batch 1 ({res['meta']['device']}, {res['meta']['date_utc']})", "",
             f"torch {res['meta']['torch']}, triton {res['meta']['triton']}, commit {args.commit}; "
             f"copy bandwidth {res['copy_GBps']:.0f} GB/s. Checks: "
             f"{'all ok' if not bad else 'FAILED ' + ', '.join(bad)}.", "",
             "| weight | bf16 cuBLAS us | engine w8a16 GEMV us | TMA int8 GEMV us (config) | TMA vs bf16 | TMA vs engine |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        u, p = r["us"], r["pct_copy_bw"]
        lines.append(f"| {r['name']} {r['n']}x{r['k']} | {u['bf16_cublas']:.1f} ({p['bf16_cublas']:.0f}%) | "
                     f"{u['engine_gemv']:.1f} ({p['engine_gemv']:.0f}%) | {u[r['best']]:.1f} "
                     f"({p[r['best']]:.0f}%, {r['best']}) | {u['bf16_cublas'] / u[r['best']]:.2f}x | "
                     f"{u['engine_gemv'] / u[r['best']]:.2f}x |")
    md = "\n".join(lines) + "\n"
    (args.out / "tma_int8_gemv.json").write_text(json.dumps(res, indent=1))
    (args.out / "tma_int8_gemv.md").write_text(md)
    print(md, flush=True)


if __name__ == "__main__":
    main()

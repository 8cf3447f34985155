"""The tensor-core 4-bit GEMV (kernels/w4_mma_gemv.py) and the warpgroup-MMA kernel
for more rows (kernels/w4_wgmma_gemm.py) against the fp32-loop GEMV
(kernels/int_weight_gemv.py), the weight dequantized for cuBLAS, and bf16 cuBLAS, on
the Llama-3-8B shapes at 1 to 128 rows, H200.

Every variant's output is checked against the fp32 product of the dequantized weight
first. Times: CUDA graphs over enough weight copies that every call streams from HBM
(benchmarks/cuda_timing.graph_timer), medians; GB/s counts the bytes each kernel must
read (codes, scales, zeros; bf16: the weight) over the copy bandwidth measured in the
same process.

    python benchmarks/quant/bench_w4_mma.py --out DIR            # H200, about 2 min
    python benchmarks/quant/bench_w4_mma.py --smoke --out DIR    # CPU: checks only
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.cuda_timing import graph_timer  # noqa: E402
from slipstream.kernels import w4_mma_gemv as W4  # noqa: E402
from slipstream.kernels import w4_wgmma_gemm as WG  # noqa: E402
from slipstream.kernels.int_weight_gemv import int_weight_gemv, pick_tile, tile_codes  # noqa: E402
from slipstream.quant.primitives import quantize  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}
STREAM_BYTES = 320 << 20          # copies per contender: at least this much weight a graph


def variants(p, m: int, sms: int):
    """(label, config) to time for one shape: 64-row blocks a program (NT), K splits
    around the default, groups loaded ahead (DEPTH)."""
    groups = p.k // 128
    base = W4.default_config(p, m, sms)["SPLIT"]
    out = []
    for nt in (1, 2, 4) if m <= 16 else (1, 2):
        for split in sorted({max(1, base // (2 * nt)), max(1, base // nt), min(groups, 2 * base // nt)}):
            depths = (1, 2, 3) if nt == 1 else (1, 2)
            for depth in depths:
                out.append((f"mma nt{nt} split{split} depth{depth}",
                            dict(NT=nt, SPLIT=split, DEPTH=depth, PDL=False)))
    # launched early (PDL): back to back here, each call's first weights load while the
    # call before ends (in the engine the kernel before is a norm or attention)
    out.append(("mma default, PDL", dict(W4.default_config(p, m, sms), PDL=True)))
    out.append(("mma default", dict(W4.default_config(p, m, sms), PDL=False)))
    return out


def wg_variants(p, m: int, sms: int):
    """(label, config) of the warpgroup kernel: NT tiles of WGS 64-row blocks a program,
    K splits around the one giving as many programs as the GEMV's default; with one tile a
    program also the dequantized weight through shared memory (asmem: MMAs left running)."""
    groups = p.k // 128
    base = W4.default_config(p, m, sms)["SPLIT"]
    out = []
    for nt, wgs in ((1, 1), (2, 1), (1, 2), (2, 2)):
        f = nt * wgs
        for split in sorted({max(1, base // (2 * f)), max(1, base // f), min(groups, 2 * base // f)}):
            out.append((f"wgmma nt{nt} wgs{wgs} split{split}", dict(NT=nt, WGS=wgs, SPLIT=split)))
            if nt == 1:
                out.append((f"wgmma asmem wgs{wgs} split{split}",
                            dict(NT=1, WGS=wgs, SPLIT=split, ASMEM=True)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--rows", default="1,4,16,32,64,128")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--quick", action="store_true", help="the default launch only, with and without PDL")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.smoke:       # the packing and twins on the CPU (the kernel needs a GPU)
        codes = torch.randint(0, 16, (256, 512), dtype=torch.uint8)
        s, z = torch.rand(256, 4), torch.randint(0, 16, (256, 4), dtype=torch.uint8)
        p = W4.pack_w4_mma(codes, s, z)
        assert torch.equal(W4.unpack_w4_mma(p), codes)
        print("smoke: pack round trip ok")
        return 0
    from slipstream.analysis.hardware import measure_copy_bandwidth
    from slipstream.kernels.runtime import num_sms
    dev = torch.device("cuda")
    sms = num_sms(0)
    copy_bw = measure_copy_bandwidth("cuda")
    gen = torch.Generator().manual_seed(0)
    rows_m = [int(r) for r in args.rows.split(",")]
    results = []
    t0 = time.perf_counter()
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        w = (torch.randn(n, k, generator=gen) * 0.02).to(dev)
        q = quantize(w, 4, False, "group", 128)
        codes, scale, zero = q.codes.to(torch.uint8), q.scale.float().contiguous(), q.zero.to(torch.uint8).contiguous()
        dense = ((codes.float() - zero.float().repeat_interleave(128, 1))
                 * scale.repeat_interleave(128, 1))                       # [n, k] fp32
        wbf = dense.to(torch.bfloat16)
        tile = pick_tile(k, 128, 4)
        tiled = (tile_codes(codes, 4, tile).contiguous(), scale, zero)
        packed = W4.pack_w4_mma(codes, scale, zero)
        del w, q
        int4_bytes = n * k // 2 + scale.numel() * 4 + zero.numel()
        for m in rows_m:
            x = (torch.randn(m, k, generator=gen) * 0.5).to(dev, torch.bfloat16)
            want = x.float() @ dense.t()
            scale_ref = want.abs().max().item()
            cands = {"bf16 cuBLAS": (lambda wb: F.linear(x, wb), [wbf], n * k * 2)}
            if m <= 4:
                cands["fp32-loop GEMV"] = (lambda t: int_weight_gemv(x, *t, 4, 128, tile),
                                           [tiled], int4_bytes)
            mma = variants(packed, m, sms) if m <= W4.MAX_ROWS else []
            for label, cfg in mma[-2:] if args.quick else mma:
                cands[label] = ((lambda p, c=cfg: W4.w4_mma_gemv(x, p, c)), [packed], int4_bytes)
            if m > 8 and WG.wgmma_supported(x):
                for label, cfg in wg_variants(packed, m, sms):
                    cands[label] = ((lambda p, c=cfg: WG.w4_wgmma_gemm(x, p, c)), [packed],
                                    int4_bytes)
            if m >= 16:    # the alternative the engine's tuner weighs from 16 rows
                cands["dequantize + cuBLAS"] = (
                    lambda p: F.linear(x, W4.dequantize_w4_mma(p, x.dtype)), [packed], int4_bytes)
            row = dict(shape=name, n=n, k=k, m=m)
            for label, (fn, (arg,), nbytes) in cands.items():
                try:
                    y = fn(arg)
                    err = (y.float() - want).abs().max().item() / scale_ref
                    if not math.isfinite(err) or err > 2e-2:
                        row[label] = dict(error=f"wrong: relative error {err:.3g}")
                        print(name, m, label, row[label], flush=True)
                        continue
                    copies = max(2, math.ceil(STREAM_BYTES / nbytes))
                    args_c = [arg] + [_clone(arg) for _ in range(copies - 1)]
                    ms = graph_timer([(lambda a=a: fn(a)) for a in args_c])()
                    del args_c
                    us = ms * 1e3
                    row[label] = dict(us=round(us, 2), rel_err=round(err, 5),
                                      pct_copy_bw=round(100 * nbytes / (us * 1e-6) / copy_bw, 1))
                except Exception as e:        # a variant that fails to compile or run: reported
                    row[label] = dict(error=repr(e)[:300])
                print(name, m, label, row[label], flush=True)
            if m == rows_m[-1]:    # the dequantizer alone: bytes read and written
                ms = graph_timer([(lambda a=a: W4.dequantize_w4_mma(a, torch.bfloat16))
                                  for a in [packed] + [_clone(packed) for _ in range(3)]])()
                row["dequantize_us"] = round(ms * 1e3, 2)
                row["dequantize_pct_copy_bw"] = round(
                    100 * (int4_bytes + n * k * 2) / (ms * 1e-3) / copy_bw, 1)
                print(name, "dequantize", row["dequantize_us"], "us",
                      row["dequantize_pct_copy_bw"], "% copy bw", flush=True)
            base = row["bf16 cuBLAS"].get("us")
            loop = row.get("fp32-loop GEMV", {}).get("us")
            timed = {lb: r["us"] for lb, r in row.items() if isinstance(r, dict) and "us" in r
                     and lb.startswith(("mma", "wgmma"))}
            if timed:
                best = min(timed, key=timed.get)
                row["best_mma"] = best
                row["best_vs_bf16"] = round(base / timed[best], 3) if base else None
                row["best_vs_loop"] = round(loop / timed[best], 3) if loop else None
                print(f"== {name} m={m}: best {best} {timed[best]:.1f} us, "
                      f"{row['best_vs_bf16']}x bf16, {row['best_vs_loop']}x fp32 loop", flush=True)
            results.append(row)
            torch.cuda.empty_cache()
    if (ROOT / "COMMIT").exists():        # a checkout without git history
        commit = (ROOT / "COMMIT").read_text().strip()
    else:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, cwd=ROOT).stdout.strip()
    meta = dict(device=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(),
                torch=torch.__version__, triton=__import__("triton").__version__, commit=commit,
                copy_gbs=round(copy_bw / 1e9, 1), seconds=round(time.perf_counter() - t0, 1))
    (out / "w4_mma.json").write_text(json.dumps(dict(meta=meta, rows=results), indent=1))
    print(json.dumps(meta))
    return 0


def _clone(a):
    if isinstance(a, torch.Tensor):
        return a.clone()
    if isinstance(a, tuple):
        return tuple(t.clone() for t in a)
    return W4.W4Mma(a.words.clone(), a.scales.clone(), a.zeros.clone(), a.n, a.k)


if __name__ == "__main__":
    sys.exit(main())

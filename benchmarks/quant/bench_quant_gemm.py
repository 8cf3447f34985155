"""Quantized GEMM kernels vs the bf16 cuBLAS matmul, at Llama-3-8B's linear shapes.

1. Correctness first, in bf16 (the dtype the interpreter cannot check): every kernel
   against its PyTorch twin at every shape, relative Frobenius error recorded;
   a failing kernel is reported and not timed.
2. Ceilings measured in the same run: device-to-device copy bandwidth.
3. Timing: each contender replayed in a CUDA graph over several weight copies (total
   bytes > 4x the 50 MB L2, so weights stream from HBM as in a real decode step), median
   of interleaved rounds: bf16 F.linear (cuBLAS), w4a16 (ours, int4 group 128 asym),
   w8a16 (ours, int8 per channel), W8A8 int8 (ours; torch._int_mm where it runs),
   W8A8 fp8 (torch._scaled_mm, row-wise scales). Activation quantization (per-token
   scale + cast, one Triton kernel) is timed separately and included in the W8A8 totals.
   Our kernels pick their launch configuration by timing a fixed candidate set on their
   first call at each (shape, batch bucket) (kernels/quant_tuning.py), as they do in the
   engine's warm-up; the chosen configurations are written to the results.
   Reported: time, speedup over bf16, weight+activation bytes / time in GB/s and as a
   share of the measured copy bandwidth, TFLOP/s.
4. The matmul part of one step (32 layers x the four shapes) at each batch; batch 2048
   stands for a prefill chunk (the W8A8 target: prefill >= 1.5x bf16).

    python benchmarks/quant/bench_quant_gemm.py [--out DIR]      # H200, about 2 minutes
    TRITON_INTERPRET=1 python benchmarks/quant/bench_quant_gemm.py --smoke   # CPU check
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from slipstream.kernels import quant_tuning, reference            # noqa: E402
from slipstream.kernels.quant_act import quantize_rows              # noqa: E402
from slipstream.kernels.int_weight_gemv import pick_tile, tile_codes  # noqa: E402
from slipstream.kernels.quant_gemm import int_weight_gemm, tiled_int_weight_gemm  # noqa: E402
from slipstream.kernels.w8a8_gemm import w8a8_gemm  # noqa: E402
from slipstream.quant.primitives import (pack_codes, quantize, quantize_fp8_rows,  # noqa: E402
                                         quantize_int8_rows)

# Llama-3-8B linear layers (N, K): fused qkv, o, fused gate+up, down.
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
BATCHES = [1, 16, 64, 2048]
SMOKE_SHAPES = {"qkv": (96, 64), "down": (64, 192)}
SMOKE_BATCHES = [1, 20]
L2_BYTES = 50 << 20


def clone_weights(W):
    """Same values in fresh memory (timing rotates over copies so weights come from HBM)."""
    return {key: tuple(t.clone() for t in v) if isinstance(v, tuple) else v.clone()
            for key, v in W.items()}


def make_weights(n, k, device, gen, dtype):
    # Quantized on the device itself: the CPU would spend minutes on the 8B shapes.
    w = torch.randn(n, k, generator=gen, device="cpu").to(device) * 0.02
    q4 = quantize(w, 4, False, "group", 128)
    q8 = quantize(w, 8, True, "channel")
    wi8, wsi8 = quantize_int8_rows(w)
    wf8, wsf8 = quantize_fp8_rows(w)
    t = lambda x: x.to(device).contiguous()  # noqa: E731
    return {"bf16": t(w.to(dtype)),
            "w4": (t(pack_codes(q4.codes, 4)), t(q4.scale.float()), t(q4.zero.to(torch.uint8))),
            "w8": (t(q8.codes), t(q8.scale.float())),
            "w4t": (t(tile_codes(q4.codes, 4, pick_tile(k, 128, 4))), t(q4.scale.float()),
                    t(q4.zero.to(torch.uint8))),
            "w8t": (t(tile_codes(q8.codes, 8, pick_tile(k, k, 8))), t(q8.scale.float())),
            "i8": (t(wi8), t(wsi8.flatten())), "f8": (t(wf8), t(wsf8.flatten()))}


def contenders(x, W, device):
    """name -> (zero-arg call, bytes it must move from memory at least)."""
    m, k = x.shape
    n = W["bf16"].shape[0]
    out_bytes = m * n * 2
    x_bytes = m * k * 2
    c = {"bf16": (lambda: F.linear(x, W["bf16"]), n * k * 2 + x_bytes + out_bytes)}
    qw, s, z = W["w4"]
    c["w4a16"] = (lambda: int_weight_gemm(x, qw, s, z, 4, 128),
                  qw.numel() + s.numel() * 4 + z.numel() + x_bytes + out_bytes)
    q8, s8 = W["w8"]
    c["w8a16"] = (lambda: int_weight_gemm(x, q8, s8, None, 8, k),
                  q8.numel() + s8.numel() * 4 + x_bytes + out_bytes)
    w4t, s4t, z4t = W["w4t"]
    c["w4a16-tiled"] = (lambda: tiled_int_weight_gemm(x, w4t, s4t, z4t, 4, 128,
                                                      pick_tile(k, 128, 4)),
                        w4t.numel() * 4 + s4t.numel() * 4 + z4t.numel() + x_bytes + out_bytes)
    w8t, s8t = W["w8t"]
    c["w8a16-tiled"] = (lambda: tiled_int_weight_gemm(x, w8t, s8t, None, 8, k, pick_tile(k, k, 8)),
                        w8t.numel() * 4 + s8t.numel() * 4 + x_bytes + out_bytes)
    wi8, wsi8 = W["i8"]
    quant = quantize_rows if device == "cuda" else \
        lambda t, kind: quantize_int8_rows(t) if kind == "int8" else quantize_fp8_rows(t)
    c["w8a8-int8"] = (lambda: w8a8_gemm(*quant(x, "int8"), wi8, wsi8, x.dtype),
                      wi8.numel() + x_bytes + out_bytes)
    c["act-quant-int8"] = (lambda: quant(x, "int8"), x_bytes * 3 // 2)
    if device == "cuda":
        if m > 16:   # torch._int_mm needs m > 16 on CUDA
            wt = wi8.t()
            c["w8a8-int8-torch"] = (lambda: _int_mm_scaled(x, wt, wsi8),
                                    wi8.numel() + x_bytes + out_bytes)
        wf8, wsf8 = W["f8"]
        wft, wsf = wf8.t(), wsf8.view(1, -1)

        def fp8():
            xq, xs = quant(x, "fp8")
            return torch._scaled_mm(xq, wft, scale_a=xs, scale_b=wsf, out_dtype=x.dtype)
        c["w8a8-fp8"] = (fp8, wf8.numel() + x_bytes + out_bytes)
    return c


def _int_mm_scaled(x, wt, ws):
    xq, xs = quantize_rows(x, "int8")
    return (torch._int_mm(xq, wt).float() * xs * ws[None, :]).to(x.dtype)


def references(x, W):
    k = x.shape[1]
    xf = x.float()
    qw, s, z = W["w4"]
    q8, s8 = W["w8"]
    wi8, wsi8 = W["i8"]
    wf8, wsf8 = W["f8"]
    xq, xs = quantize_int8_rows(x)
    xf8, xsf8 = quantize_fp8_rows(x)
    return {"bf16": F.linear(xf, W["bf16"].float()),
            "w4a16": reference.int_weight_linear(xf, qw, s, z, 4, 128),
            "w8a16": reference.int_weight_linear(xf, q8, s8, None, 8, k),
            "w4a16-tiled": reference.int_weight_linear(xf, qw, s, z, 4, 128),
            "w8a16-tiled": reference.int_weight_linear(xf, q8, s8, None, 8, k),
            "w8a8-int8": reference.w8a8_linear(xq, xs, wi8, wsi8, torch.float32),
            "w8a8-int8-torch": reference.w8a8_linear(xq, xs, wi8, wsi8, torch.float32),
            "w8a8-fp8": (F.linear(xf8.float() * xsf8, wf8.float()) * wsf8[None, :])}


def rel_err(out, ref) -> float:
    out, ref = out.double(), ref.double()
    if out.isnan().any():
        return float("inf")
    return ((out - ref).norm() / ref.norm()).item()


def graph_ms(calls, replays=10, min_calls=32) -> float:
    """Median ms per call of `calls` (different weight copies) replayed in a CUDA graph."""
    from benchmarks.cuda_timing import graph_timer
    return graph_timer(calls, min_calls, replays)()


def cpu_ms(calls) -> float:
    t = time.perf_counter()
    for f in calls:
        f()
    return (time.perf_counter() - t) * 1e3 / len(calls)


def copy_bandwidth(device) -> float:
    if device != "cuda":
        return float("nan")
    src = torch.empty(1 << 29, dtype=torch.float32, device=device)   # 2 GiB
    dst = torch.empty_like(src)
    ms = graph_ms([lambda: dst.copy_(src)], min_calls=8)
    return 2 * src.numel() * 4 / (ms * 1e-3)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (interpreter)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--kernels", default=None,
                    help="comma-separated contenders to run (bf16 always runs); default all")
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes (default all)")
    args = ap.parse_args(argv)
    device = "cpu" if args.smoke else "cuda"
    dtype = torch.float16 if args.smoke else torch.bfloat16   # the interpreter lacks bf16 dot
    shapes, batches = (SMOKE_SHAPES, SMOKE_BATCHES) if args.smoke else (SHAPES, BATCHES)
    if args.batches:
        batches = [int(b) for b in args.batches.split(",")]
    wanted = None if not args.kernels else {"bf16", *args.kernels.split(",")}
    gen = torch.Generator().manual_seed(0)
    copy_bw = copy_bandwidth(device)
    print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s", flush=True)
    res = {"meta": {"device": torch.cuda.get_device_name() if device == "cuda" else
                    platform.processor() or "cpu", "torch": torch.__version__,
                    "dtype": str(dtype), "smoke": args.smoke, "copy_bytes_per_s": copy_bw},
           "correctness": [], "timing": []}
    failed = set()
    for name, (n, k) in shapes.items():
        base = make_weights(n, k, device, gen, dtype)
        copies = 1 if args.smoke else max(1, math.ceil(4 * L2_BYTES / (n * k / 2)))
        weights = [base] + [clone_weights(base) for _ in range(min(copies, 8) - 1)]
        for m in batches:
            x = (torch.randn(m, k, generator=gen) * 1.0).to(device, dtype)
            refs = references(x, base)
            cons = contenders(x, base, device)
            if wanted is not None:
                cons = {c: v for c, v in cons.items() if c in wanted}
            for cname, (fn, _) in cons.items():
                if cname not in refs:
                    continue
                try:
                    err = rel_err(fn().float(), refs[cname])
                except Exception as e:   # e.g. a torch op this GPU or build lacks
                    print(f"ERROR {cname} {name} m={m}: {type(e).__name__}: {e}", flush=True)
                    err = float("inf")
                tol = 2e-2 if cname != "w8a8-fp8" else 3e-2
                ok = err < tol
                res["correctness"].append({"shape": name, "m": m, "kernel": cname,
                                           "rel_err": err, "ok": ok})
                if not ok:
                    failed.add(cname)
                    print(f"FAIL {cname} {name} m={m}: rel err {err:.3g}", flush=True)
            per = [contenders(x, W, device) for W in weights]
            timers = {c: [p[c][0] for p in per] for c in cons if c not in failed}
            timers = {c: v for c, v in timers.items() if wanted is None or c in wanted}
            times = {c: [] for c in timers}
            for _ in range(1 if args.smoke else args.rounds):
                for c, calls in timers.items():
                    times[c].append(cpu_ms(calls) if args.smoke else graph_ms(calls))
            bf16_ms = statistics.median(times["bf16"])
            for c, ts in times.items():
                ms = statistics.median(ts)
                nbytes = cons[c][1]
                row = {"shape": name, "n": n, "k": k, "m": m, "kernel": c, "ms": ms,
                       "spread": (max(ts) - min(ts)) / ms if ms else 0.0,
                       "speedup_vs_bf16": bf16_ms / ms, "GB_per_s": nbytes / (ms * 1e-3) / 1e9,
                       "pct_copy_bw": 100 * nbytes / (ms * 1e-3) / copy_bw,
                       "TFLOP_per_s": 2 * m * n * k / (ms * 1e-3) / 1e12}
                res["timing"].append(row)
            line = "  ".join(f"{c} {statistics.median(t) * 1e3:.1f}us"
                             f" ({bf16_ms / statistics.median(t):.2f}x)" for c, t in times.items())
            print(f"{name:8s} m={m:<4d} {line}", flush=True)
        del weights
    res["decode_step_matmuls"] = step_totals(res["timing"], batches, shapes)
    res["tuned_configs"] = [{"key": [str(v) for v in key], "config": cfg}
                            for key, cfg in quant_tuning.tuned_configs().items()]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "quant_gemm_smoke" if args.smoke else "quant_gemm"
    (out / f"{stem}.json").write_text(json.dumps(res, indent=1))
    (out / f"{stem}.md").write_text(markdown(res))
    print(f"wrote {out / stem}.json/.md; correctness failures: {sorted(failed) or 'none'}")
    return 1 if failed else 0


def step_totals(timing, batches, shapes) -> list:
    """32 layers x (qkv + o + gate_up + down): the matmul time of one decode step."""
    rows = []
    for m in batches:
        per = {}
        for r in timing:
            if r["m"] == m:
                per.setdefault(r["kernel"], {})[r["shape"]] = r["ms"]
        for kernel, d in per.items():
            if len(d) == len(shapes) and kernel != "act-quant-int8":
                rows.append({"m": m, "kernel": kernel, "ms": 32 * sum(d.values()),
                             "speedup_vs_bf16": sum(per["bf16"].values()) / sum(d.values())})
    return rows


def markdown(res) -> str:
    meta = res["meta"]
    lines = [f"# Quantized GEMMs vs bf16 cuBLAS ({meta['device']}, torch {meta['torch']})", "",
             f"Copy bandwidth measured in the same run: {meta['copy_bytes_per_s'] / 1e9:.0f} GB/s. "
             "Times: CUDA graph replay over weight copies (> 4x L2), median of interleaved "
             "rounds. W8A8 times include the per-token activation quantization.", "",
             "| shape | m | kernel | us | x bf16 | GB/s | % copy BW | TFLOP/s |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in res["timing"]:
        lines.append(f"| {r['shape']} | {r['m']} | {r['kernel']} | {r['ms'] * 1e3:.1f} | "
                     f"{r['speedup_vs_bf16']:.2f} | {r['GB_per_s']:.0f} | {r['pct_copy_bw']:.0f} | "
                     f"{r['TFLOP_per_s']:.1f} |")
    lines += ["", "## Matmuls of one step (32 layers x 4 shapes)", "",
              "| m | kernel | ms | x bf16 |", "| ---: | --- | ---: | ---: |"]
    for r in res["decode_step_matmuls"]:
        lines.append(f"| {r['m']} | {r['kernel']} | {r['ms']:.3f} | {r['speedup_vs_bf16']:.2f} |")
    if res.get("tuned_configs"):
        lines += ["", "## Launch configurations chosen by tuning (kernel, N, K, ..., batch bucket)",
                  ""]
        lines += [f"- {', '.join(c['key'])}: {c['config']}" for c in res["tuned_configs"]]
    bad = [c for c in res["correctness"] if not c["ok"]]
    lines += ["", f"Correctness (bf16 vs PyTorch twin, rel. Frobenius error < 2e-2, fp8 3e-2): "
              f"{len(res['correctness']) - len(bad)} of {len(res['correctness'])} passed."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())

"""Kernel-level part of bench_w8a8_prefill.py: the W8A8 GEMM candidates and the quantizing
producers (RMSNorm, SiLU * up) at prefill size, correctness first, then time.

GEMMs at M tokens over Llama-3-8B's four linear shapes:
  bf16            F.linear (cuBLAS)
  int8-triton     kernels/w8a8_gemm.py with each prefill tile configuration (base, wide
                  and TMA sets), activations already quantized
  int8-intmm-raw  torch._int_mm alone (cuBLAS int8, int32 out, no rescale: a lower bound
                  of what a cuBLAS int8 path could cost)
  fp8-scaled_mm   torch._scaled_mm, row-wise scales, bf16 out
  fp8-triton      kernels/w8a8_gemm.py on float8 e4m3 operands, each configuration
Producers at M tokens: add+RMSNorm [M, 4096] then quantize_rows, against the fused
rms_norm(..., quant=); silu_and_mul [M, 2 x 14336] then quantize_rows, against
silu_and_mul_quant. Codes must agree with the unfused path (one step at most, a tiny share).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from slipstream.kernels import reference
from slipstream.kernels.quant_act import quantize_rows
from slipstream.kernels.rms_norm import rms_norm
from slipstream.kernels.silu_mul import silu_and_mul, silu_and_mul_quant
from slipstream.kernels.w8a8_gemm import _LARGE_SETS, _cfg, w8a8_gemm
from slipstream.quant.fp8 import fp8_linear_reference
from slipstream.quant.primitives import quantize_fp8_rows, quantize_int8_rows

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
SMOKE_SHAPES = {"qkv": (96, 64), "down": (64, 192)}


def rel_err(out, ref) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm()).item()


def configs(smoke: bool) -> list[dict]:
    """Every prefill tile configuration of kernels/w8a8_gemm.py (base, wide, TMA)."""
    if smoke:
        return [_cfg(16, 32, 32, 4, 2), _cfg(32, 32, 64, 4, 2), _cfg(16, 32, 64, 4, 2, "tma"),
                _cfg(16, 32, 64, 4, 2, "tma-persistent")]
    seen, out = set(), []
    for c in _LARGE_SETS["all"]:
        if c not in seen:
            seen.add(c)
            out.append(_cfg(*c))
    return out


def _name(cfg) -> str:
    return "{BLOCK_M}x{BLOCK_N}x{BLOCK_K}/w{num_warps}/s{num_stages}".format(**cfg) + (
        f"/{cfg['KERNEL']}" if "KERNEL" in cfg else "")


def gemm_rows(m: int, device: str, timer, smoke: bool) -> list[dict]:
    """One row per (shape, kernel[, config]): rel. error vs the twin, ms, TFLOP/s. The TMA
    candidates run last (over every shape), so a fault there cannot cost the others."""
    dtype = torch.float32 if smoke else torch.bfloat16
    gen = torch.Generator(device="cpu").manual_seed(0)
    tasks = []          # (shape, flop, kernel, fn, ref, tol, cfg)
    for shape, (n, k) in (SMOKE_SHAPES if smoke else SHAPES).items():
        x = torch.randn(m, k, generator=gen).to(device, dtype)
        w = (torch.randn(n, k, generator=gen) * 0.02).to(device)
        flop = 2 * m * n * k
        add = lambda *t, s=shape, f=flop: tasks.append((s, f) + t)  # noqa: E731
        wb = w.to(dtype)
        add("bf16", lambda x=x, wb=wb: F.linear(x, wb), F.linear(x.float(), wb.float()), 2e-2)
        wq, ws = quantize_int8_rows(w)
        ws = ws.flatten()
        xq, xs = quantize_int8_rows(x)
        ref8 = reference.w8a8_linear(xq, xs, wq, ws, torch.float32)
        for cfg in configs(smoke):
            add("int8-triton", lambda c=cfg, a=(xq, xs, wq, ws): w8a8_gemm(*a, dtype, c), ref8,
                1e-2, cfg)
        if device == "cuda":
            add("int8-intmm-raw", lambda a=(xq, wq.t()): torch._int_mm(*a),
                (xq.double() @ wq.double().t()).float(), 1e-6)
            fq, fs = quantize_fp8_rows(w)
            fs = fs.flatten()
            xf, xfs = quantize_rows(x, "fp8")
            reff = fp8_linear_reference(xf, xfs, fq, fs, torch.float32)
            add("fp8-scaled_mm", lambda a=(xf, fq.t(), xfs, fs.view(1, -1)): torch._scaled_mm(
                a[0], a[1], scale_a=a[2], scale_b=a[3], out_dtype=dtype), reff, 1e-2)
            for cfg in configs(smoke):
                add("fp8-triton", lambda c=cfg, a=(xf, xfs, fq, fs): w8a8_gemm(*a, dtype, c),
                    reff, 1e-2, cfg)
        del w
    tasks.sort(key=lambda t: len(t) > 6 and t[6] is not None and "KERNEL" in t[6])
    rows = []
    for shape, flop, kernel, fn, ref, tol, *cfg in tasks:
        cfg = cfg[0] if cfg else None
        name = _name(cfg) if cfg else None
        try:
            err = rel_err(fn().float(), ref)
        except Exception as e:          # e.g. too much shared memory for a tile
            rows.append({"shape": shape, "kernel": kernel, "config": name,
                         "error": repr(e)[:160]})
            continue
        row = {"shape": shape, "kernel": kernel, "config": name, "rel_err": err,
               "ok": err < tol}
        if row["ok"]:
            row["ms"] = timer(fn)
            row["tflops"] = flop / row["ms"] / 1e9
        rows.append(row)
    return rows


def _code_diff(q, qr) -> tuple[float, float]:
    d = (q.float() - qr.float()).abs()
    return d.max().item(), (d > 0).float().mean().item()


def producer_rows(m: int, device: str, timer, smoke: bool) -> list[dict]:
    """Unfused (producer, then quantize_rows) vs fused, int8 and fp8 (fp8 on CUDA only)."""
    dtype = torch.float32 if smoke else torch.bfloat16
    hidden, inter = (64, 96) if smoke else (4096, 14336)
    gen = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(m, hidden, generator=gen).to(device, dtype)
    res = torch.randn(m, hidden, generator=gen).to(device, dtype)
    wn = (torch.rand(hidden, generator=gen) + 0.5).to(device, dtype)
    gu = (torch.randn(m, 2 * inter, generator=gen) * 2).to(device, dtype)
    rows = []
    kinds = ["int8"] + (["fp8"] if device == "cuda" else [])
    for kind in kinds:
        pairs = {
            "norm": (lambda: quantize_rows(rms_norm(x, wn, 1e-5, res)[0], kind),
                     lambda: rms_norm(x, wn, 1e-5, res, kind)[0],
                     lambda: rms_norm(x, wn, 1e-5, res)),
            "silu_mul": (lambda: quantize_rows(silu_and_mul(gu), kind),
                         lambda: silu_and_mul_quant(gu, kind, one_pass=False),
                         lambda: silu_and_mul(gu)),
            "silu_mul one-pass": (lambda: quantize_rows(silu_and_mul(gu), kind),
                                  lambda: silu_and_mul_quant(gu, kind, one_pass=True),
                                  lambda: silu_and_mul(gu))}
        for name, (unfused, fused, plain) in pairs.items():
            (qu, su), (qf, sf) = unfused(), fused()
            dmax, share = _code_diff(qf, qu)
            scale_err = ((sf - su).abs() / su).max().item()
            ok = scale_err < 2e-3 and (dmax <= 1 if kind == "int8" else True) and share < 0.01
            row = {"producer": name, "kind": kind, "code_max_diff": dmax,
                   "code_diff_share": share, "scale_rel_err": scale_err, "ok": ok}
            if ok:
                row.update(plain_ms=timer(plain), unfused_ms=timer(unfused), fused_ms=timer(fused))
            rows.append(row)
    return rows


def host_rows(m: int, device: str, calls: int = 50) -> list[dict]:
    """Host time per call of each launch path (enqueue only: `calls` calls issued with no
    synchronization, few enough that the launch queue never fills): what a prefill pays
    on the CPU per kernel, whether or not the GPU waits for it."""
    import time
    if device != "cuda":
        return []
    from slipstream.kernels.quant_act import quantize_rows as qr
    dtype = torch.bfloat16
    n, k = SHAPES["qkv"]
    x = torch.randn(m, k, device=device, dtype=dtype)
    w = torch.randn(n, k, device=device, dtype=dtype) * 0.02
    wq, ws = quantize_int8_rows(w)
    ws = ws.flatten()
    fq, fs = quantize_fp8_rows(w)
    fs = fs.flatten()
    xq, xs = qr(x, "int8")
    xf, xfs = qr(x, "fp8")
    ft, fsr = fq.t(), fs.view(1, -1)
    wn = torch.ones(k, device=device, dtype=dtype)
    gu = torch.randn(m, 2 * k, device=device, dtype=dtype)
    paths = {
        "F.linear bf16": lambda: F.linear(x, w),
        "quantize_rows": lambda: qr(x, "int8"),
        "w8a8_gemm int8 (tuned)": lambda: w8a8_gemm(xq, xs, wq, ws, dtype),
        "w8a8_gemm fp8 (tuned)": lambda: w8a8_gemm(xf, xfs, fq, fs, dtype),
        "_scaled_mm fp8": lambda: torch._scaled_mm(xf, ft, scale_a=xfs, scale_b=fsr,
                                                   out_dtype=dtype),
        "rms_norm + residual": lambda: rms_norm(x, wn, 1e-5, x),
        "rms_norm + residual, int8 out": lambda: rms_norm(x, wn, 1e-5, x, "int8"),
        "silu_and_mul": lambda: silu_and_mul(gu),
        "silu_and_mul_quant int8": lambda: silu_and_mul_quant(gu, "int8"),
        "torch.empty": lambda: torch.empty(m, n, device=device, dtype=dtype),
    }
    rows = []
    for name, fn in paths.items():
        fn()
        best = float("inf")
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            best = min(best, (time.perf_counter() - t0) / calls)
        rows.append({"path": name, "host_us": best * 1e6})
    torch.cuda.synchronize()
    return rows

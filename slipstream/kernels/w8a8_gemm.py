"""W8A8 GEMM: int8 x int8 (int32 accumulation, exact) or float8 e4m3 x e4m3 (fp32
accumulation) tiles on the tensor cores, then the per-token x per-channel rescale in the
epilogue:

    y[m, n] = (sum_k xq[m, k] * wq[n, k]) * x_scale[m] * w_scale[n]   in the output dtype.

One kernel for both formats (the operand dtype picks the accumulator), with pointer loads;
a second with TMA tile loads (Hopper), one program per tile or persistent programs. Tiles
run in grouped order (GROUP_M row blocks share a weight column block while it is in L2).
The launch configuration is chosen by timing (kernels/quant_tuning.choose) once per
(weight shape, dtypes, token bucket) from the candidates of `w8a8_candidates`; float8 with
bf16 output also has torch._scaled_mm (row-wise scales) as a candidate (`fp8_mode`).

Plain-PyTorch twin: reference.w8a8_linear (int8 and fp8).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from slipstream.kernels import quant_tuning
from slipstream.kernels import runtime  # noqa: F401  (interpreter fixes for CPU tests)
from slipstream.kernels.quant_gemm import _grouped_tile

W8A8_DTYPES = (torch.int8, torch.float8_e4m3fn)


@triton.jit
def _w8a8_gemm_kernel(XQ, XS, WQ, WS, Y, M, N, K, stride_xm, stride_wn, stride_ym,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      GROUP_M: tl.constexpr, INT8: tl.constexpr):
    pid_m, pid_n = _grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    # Clamped rows/columns (not masked) keep the loads unmasked along M and N; the
    # store drops them.
    rm_c = tl.minimum(rm, M - 1).to(tl.int64)
    rn_c = tl.minimum(rn, N - 1).to(tl.int64)
    if INT8:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        # other=0.0: a float zero casts to int8 and to float8 alike (an integer zero does
        # not cast to float8).
        a = tl.load(XQ + rm_c[:, None] * stride_xm + rk[None, :], mask=k_ok[None, :], other=0.0)
        b = tl.load(WQ + rn_c[:, None] * stride_wn + rk[None, :], mask=k_ok[None, :], other=0.0)
        if INT8:
            acc += tl.dot(a, tl.trans(b), out_dtype=tl.int32)
        else:
            acc = tl.dot(a, tl.trans(b), acc)
    xs = tl.load(XS + rm, mask=m_ok, other=0.0)
    ws = tl.load(WS + rn, mask=n_ok, other=0.0)
    y = acc.to(tl.float32) * xs[:, None] * ws[None, :]
    tl.store(Y + rm[:, None].to(tl.int64) * stride_ym + rn[None, :],
             y.to(Y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _w8a8_tma_kernel(a_desc, b_desc, XS, WS, Y, M, N, K, stride_ym, PROGRAMS,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr, INT8: tl.constexpr):
    """The same product with the tiles fetched by the tensor-memory accelerator (Hopper:
    TMA descriptors, out-of-range rows / columns read as zeros) and, when PROGRAMS is
    smaller than the tile count, persistent programs that walk the tiles PROGRAMS apart
    (one wave, no tail of half-empty SMs)."""
    tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles, PROGRAMS):
        pid_m, pid_n = _grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        if INT8:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = a_desc.load([off_m, k0])
            b = b_desc.load([off_n, k0])
            if INT8:
                acc += tl.dot(a, b.T, out_dtype=tl.int32)
            else:
                acc = tl.dot(a, b.T, acc)
        rm = off_m + tl.arange(0, BLOCK_M)
        rn = off_n + tl.arange(0, BLOCK_N)
        xs = tl.load(XS + rm, mask=rm < M, other=0.0)
        ws = tl.load(WS + rn, mask=rn < N, other=0.0)
        y = acc.to(tl.float32) * xs[:, None] * ws[None, :]
        tl.store(Y + rm[:, None].to(tl.int64) * stride_ym + rn[None, :],
                 y.to(Y.dtype.element_ty), mask=(rm < M)[:, None] & (rn < N)[None, :])


def _cfg(bm, bn, bk, warps, stages, kernel: str | None = None) -> dict:
    """kernel: None (pointer loads), "tma" (one program per tile) or "tma-persistent"."""
    cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    if kernel is not None:
        cfg["KERNEL"] = kernel
    return cfg


# Prefill-sized M (measured on an H200 at M=2048 over Llama-3-8B's four linear shapes,
# benchmarks/quant/results/w8a8_prefill_h200_2026-11-30_c9fc53b.md): int8 is fastest with
# 128x128x128 tiles, 8 warps, 3 stages on every shape (1,300-1,460 TFLOP/s), in the "base"
# set; float8 with the TMA kernels (128x256x128), which beat torch._scaled_mm on three
# shapes of four. "wide" (128x256 / 256x128 tiles, 4-5 stages; shared memory per stage:
# (BM + BN) * BK bytes) lost on every shape.
_LARGE_BASE = [(128, 128, 128, 8, 3), (128, 256, 128, 8, 3), (128, 128, 64, 4, 4),
               (64, 128, 128, 4, 4), (256, 128, 128, 8, 3), (128, 128, 128, 4, 4),
               (128, 256, 64, 8, 4)]
_LARGE_WIDE = [(128, 256, 128, 8, 4), (256, 128, 128, 8, 4), (128, 256, 64, 8, 5),
               (256, 128, 64, 8, 5), (128, 128, 128, 8, 5), (128, 128, 128, 4, 5),
               (128, 256, 128, 8, 3), (128, 128, 128, 8, 3), (256, 128, 128, 8, 3),
               (128, 128, 64, 4, 6)]
_LARGE_TMA = [(128, 256, 128, 8, 3, "tma"), (128, 256, 128, 8, 4, "tma"),
              (128, 128, 128, 8, 4, "tma"), (128, 256, 128, 8, 3, "tma-persistent"),
              (128, 256, 128, 8, 4, "tma-persistent"), (128, 128, 128, 8, 4, "tma-persistent"),
              (128, 256, 64, 8, 5, "tma-persistent")]
_LARGE_SETS = {"base": _LARGE_BASE, "wide": _LARGE_WIDE, "tma": _LARGE_TMA,
               "all": _LARGE_BASE + _LARGE_WIDE + _LARGE_TMA}


def w8a8_candidates(m: int, device: torch.device | None = None,
                    dtype: torch.dtype = torch.int8) -> list[dict]:
    """The configurations tuning tries at `m` tokens. Prefill-sized M: "base" for int8,
    "tma" for float8 (the measured best), or the set SLIPSTREAM_W8A8_TILES names (base,
    wide, tma, all; comparison runs). The TMA kernels only on Hopper and later (and the
    CPU interpreter)."""
    if m <= 16:
        return [_cfg(16, bn, bk, 4, st) for bn, bk, st in (
            (32, 128, 4), (64, 128, 4), (128, 128, 3), (32, 256, 3), (64, 256, 3))]
    if m <= 64:
        return [_cfg(bm, bn, 128, 4, st) for bm, bn, st in (
            (32, 64, 4), (32, 128, 4), (64, 64, 4), (64, 128, 4), (64, 128, 3))]
    tiles = os.environ.get("SLIPSTREAM_W8A8_TILES") or ("base" if dtype == torch.int8 else "tma")
    large = _LARGE_SETS.get(tiles)
    if large is None:
        raise ValueError(f"SLIPSTREAM_W8A8_TILES: expected one of {list(_LARGE_SETS)}, "
                         f"got {tiles!r}")
    if not tma_supported(device):
        large = [c for c in large if len(c) == 5] or _LARGE_BASE
    return [_cfg(*c) for c in large]


def tma_supported(device: torch.device | None) -> bool:
    if device is None or device.type != "cuda":
        return True
    from slipstream.kernels.runtime import capability
    return capability(device.index or 0) >= (9, 0)


def default_w8a8_config(m: int) -> dict:
    cfg = quant_tuning.default_config(m, 128)
    if m > 64:
        cfg["BLOCK_K"] = 128
    return cfg


SCALED_MM = {"KERNEL": "scaled_mm"}
FP8_MODES = ("auto", "scaled_mm", "triton")


def fp8_mode() -> str:
    """SLIPSTREAM_FP8_GEMM: "auto" (default: prefill-sized M tunes between torch._scaled_mm
    and the Triton TMA kernels per shape, smaller M runs torch._scaled_mm), "scaled_mm",
    or "triton" (every M through the Triton kernels; comparison runs)."""
    mode = os.environ.get("SLIPSTREAM_FP8_GEMM", "auto")
    if mode not in FP8_MODES:
        raise ValueError(f"SLIPSTREAM_FP8_GEMM: expected one of {FP8_MODES}, got {mode!r}")
    return mode


def _scaled_mm_ok(xq: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """torch._scaled_mm with row-wise scales: float8 on CUDA, bf16 output."""
    return xq.is_cuda and xq.dtype == torch.float8_e4m3fn and out_dtype == torch.bfloat16


def w8a8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
              out_dtype: torch.dtype, config: dict | None = None) -> torch.Tensor:
    """xq: int8 or float8_e4m3fn [m, k]; x_scale: fp32 [m, 1] (or [m]); wq: [n, k], the same
    dtype as xq; w_scale: fp32 [n] -> [m, n] out_dtype. `config` fixes the launch;
    otherwise tuned on CUDA. float8 with bf16 output may also run as torch._scaled_mm
    (row-wise scales, cuBLASLt / CUTLASS), one more candidate of the tuning (fp8_mode)."""
    m, k = xq.shape
    n = wq.shape[0]
    if xq.dtype not in W8A8_DTYPES or wq.dtype != xq.dtype:
        raise ValueError(f"w8a8_gemm: operands must both be int8 or both float8_e4m3fn, "
                         f"got {xq.dtype} and {wq.dtype}")
    assert wq.shape[1] == k and xq.stride(1) == 1 and wq.stride(1) == 1
    if m == 0:
        return torch.empty(m, n, dtype=out_dtype, device=xq.device)
    # The kernels index the scales as flat vectors: [m, 1] and [m] (contiguous) alike.
    xs, ws = x_scale, w_scale
    assert xs.numel() == m and ws.numel() == n and xs.is_contiguous() and ws.is_contiguous()
    if config is None:
        default = default_w8a8_config(m)
        cands = lambda: w8a8_candidates(m, xq.device, xq.dtype)  # noqa: E731
        mode = fp8_mode() if _scaled_mm_ok(xq, out_dtype) else "triton"
        if mode == "scaled_mm" or (mode == "auto" and m <= 64):
            return _launch(xq, xs, wq, ws, out_dtype, SCALED_MM)
        if mode == "auto":
            default, cands = SCALED_MM, lambda: [SCALED_MM] + w8a8_candidates(
                m, xq.device, xq.dtype)

        def timed_calls(cfg, copies):
            return [lambda w=w: _launch(xq, xs, *w, out_dtype, cfg) for w in copies]
        config = quant_tuning.choose(("w8a8", n, k, xq.dtype, out_dtype, mode), m, xq.device,
                                     default, cands, (wq, ws), timed_calls)
    return _launch(xq, xs, wq, ws, out_dtype, config)


def _launch(xq, xs, wq, ws, out_dtype, cfg):
    m, k = xq.shape
    n = wq.shape[0]
    if cfg.get("KERNEL") == "scaled_mm":
        return torch._scaled_mm(xq, wq.t(), scale_a=xs.view(-1, 1), scale_b=ws.view(1, -1),
                                out_dtype=out_dtype)
    y = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if "KERNEL" in cfg:
        cfg = dict(cfg)
        kernel = cfg.pop("KERNEL")
        return _launch_tma(xq, xs, wq, ws, y, kernel == "tma-persistent", cfg)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    _w8a8_gemm_kernel[grid](xq, xs, wq, ws, y, m, n, k, xq.stride(0), wq.stride(0), y.stride(0),
                            GROUP_M=8, INT8=xq.dtype == torch.int8, **cfg)
    return y


def _launch_tma(xq, xs, wq, ws, y, persistent: bool, cfg):
    from triton.tools.tensor_descriptor import TensorDescriptor
    m, k = xq.shape
    n = wq.shape[0]
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    a_desc = TensorDescriptor.from_tensor(xq, [bm, bk])
    b_desc = TensorDescriptor.from_tensor(wq, [bn, bk])
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    programs = tiles
    if persistent:     # (the CPU interpreter: two programs, so the tile loop is exercised)
        from slipstream.kernels.runtime import num_sms
        programs = min(tiles, num_sms(xq.device.index or 0) if xq.is_cuda else 2)
    _w8a8_tma_kernel[(programs,)](a_desc, b_desc, xs, ws, y, m, n, k, y.stride(0), programs,
                                  GROUP_M=8, INT8=xq.dtype == torch.int8,
                                  **cfg)
    return y

"""Per-token activation quantization for W8A8 in one kernel: x [m, k] -> (q [m, k],
scale [m, 1] fp32), q = round(x / scale) in int8 (scale = max|x| / 127) or float8 e4m3
(scale = max|x| / 448).

The PyTorch twins (quant/primitives.quantize_int8_rows and quantize_fp8_rows) take five
or six passes over x (abs, amax, divide, round, clamp, cast); here one program per row
reads its row twice (the maximum, then the quantization; the second read hits the cache)
and writes the codes and the scale once. The arithmetic is the twin's: an IEEE division
(div_rn), round half to even (the 1.5 * 2^23 trick, exact for |v| < 2^22), the same
clamps, so the codes are bit-identical.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from slipstream.kernels import runtime  # noqa: F401  (interpreter fixes for CPU tests)

FP8_E4M3_MAX = 448.0


@triton.jit
def quantize_block(x, scale, QMAX: tl.constexpr, FP8: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """fp32 values x and their row's scale -> codes in OUT_DTYPE (int8 or float8e4nv),
    rounded as the PyTorch twins round (shared with the fused norm and SiLU kernels)."""
    v = tl.math.div_rn(x, scale)
    if not FP8:
        v = (v + 12582912.0) - 12582912.0          # round half to even
    return tl.minimum(tl.maximum(v, -QMAX), QMAX).to(OUT_DTYPE)


@triton.jit
def row_scale(amax, QMAX: tl.constexpr, EPS: tl.constexpr):
    """A row's largest magnitude -> its scale (amax / QMAX, floored at EPS)."""
    return tl.maximum(tl.math.div_rn(amax, QMAX), EPS)


@triton.jit
def _quantize_rows_kernel(X, Q, S, K, stride_xm, stride_qm, QMAX: tl.constexpr,
                          EPS: tl.constexpr, FP8: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_xm
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        rk = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + rk, mask=rk < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = row_scale(tl.max(amax, axis=0), QMAX, EPS)
    tl.store(S + row, scale)
    for k0 in range(0, K, BLOCK):
        rk = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + rk, mask=rk < K, other=0.0).to(tl.float32)
        tl.store(Q + row * stride_qm + rk, quantize_block(x, scale, QMAX, FP8,
                                                          Q.dtype.element_ty), mask=rk < K)


_PARAMS = {"int8": dict(QMAX=127.0, EPS=1e-10, FP8=False),
           "fp8": dict(QMAX=FP8_E4M3_MAX, EPS=1e-12, FP8=True)}


def quant_params(kind: str) -> dict:
    """The constexprs of `kind` ("int8" or "fp8") for kernels that quantize rows (shared:
    do not modify)."""
    params = _PARAMS.get(kind)
    if params is None:
        raise ValueError(f"kind: expected 'int8' or 'fp8', got {kind!r}")
    return params


def empty_rows(m: int, k: int, kind: str, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised (codes [m, k], scale [m, 1] fp32) for `kind`."""
    dtype = torch.float8_e4m3fn if kind == "fp8" else torch.int8
    return (torch.empty(m, k, dtype=dtype, device=device),
            torch.empty(m, 1, dtype=torch.float32, device=device))


def quantize_rows(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [m, k] (fp16/bf16/fp32, unit stride along k) -> (q [m, k] int8 or float8_e4m3fn,
    scale [m, 1] fp32). kind: "int8" or "fp8"."""
    params = quant_params(kind)
    m, k = x.shape
    assert x.stride(1) == 1
    q, s = empty_rows(m, k, kind, x.device)
    if m == 0:
        return q, s
    block = min(2048, triton.next_power_of_2(k))
    _quantize_rows_kernel[(m,)](x, q, s, k, x.stride(0), q.stride(0), BLOCK=block,
                                num_warps=4 if block <= 1024 else 8, **params)
    return q, s

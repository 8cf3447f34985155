"""RMSNorm, optionally fused with the residual add before it, in one kernel.

Hugging Face semantics, rounding step for rounding step (see layers/norm.py):
    s   = x + residual                 (added in the model dtype: rounded once)
    out = weight * (s_fp32 * rsqrt(mean(s_fp32^2) + eps)).to(dtype)
One program normalises one row (token); the whole row is held in registers, so
x, residual and weight are read once and the two outputs written once.
With `quant` ("int8" / "fp8", when a W8A8 linear layer reads the output) the normed
row is quantized per token in the same program (kernels/quant_act.py's rounding, so
the codes equal quantize_rows(rms_norm(...))): the codes and the row's scale are
written instead of the normed row, which saves the separate quantization kernel's
read and write of every activation. The grid
is the number of rows: no host sync, no data-dependent launch, safe to capture
in a CUDA graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from slipstream.kernels.attention_tile import next_pow2
from slipstream.kernels.quant_act import empty_rows, quant_params, quantize_block, row_scale
from slipstream.kernels.runtime import pdl_elementwise


@triton.jit
def _rms_norm_kernel(X, Res, W, Out, ResOut, eps,
                     stride_x, stride_r, stride_o, stride_ro,
                     N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                     QUANT: tl.constexpr, S, QMAX: tl.constexpr, EPS: tl.constexpr,
                     FP8: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)   # a parameter: no kernel writes it
    if PDL:   # launched early: x and the residual are the kernel ahead's outputs
        gdc_wait()
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(Res + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(ResOut + row * stride_ro + cols, x, mask=mask)
    h = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(h * h, axis=0) / N + eps)
    normed = (h * inv_rms).to(X.dtype.element_ty).to(tl.float32)
    if QUANT:   # Out holds the codes; the normed row is rounded to the model dtype first
        y = (w * normed).to(X.dtype.element_ty).to(tl.float32)
        scale = row_scale(tl.max(tl.abs(y), axis=0), QMAX, EPS)
        tl.store(S + row, scale)
        tl.store(Out + row * stride_o + cols,
                 quantize_block(y, scale, QMAX, FP8, Out.dtype.element_ty), mask=mask)
    else:
        tl.store(Out + row * stride_o + cols, (w * normed).to(Out.dtype.element_ty), mask=mask)


def _num_warps(block: int) -> int:
    return max(1, min(16, block // 256))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, quant: str | None = None):
    """x: [num_tokens, hidden]; weight: [hidden] (the model dtype);
    residual: optional [num_tokens, hidden]; quant: None, "int8" or "fp8".
    -> normed [num_tokens, hidden], or (normed, x + residual) with a residual; with
    `quant`, normed is the pair (codes [num_tokens, hidden], scale [num_tokens, 1] fp32)."""
    assert x.ndim == 2 and x.stride(1) == 1 and weight.is_contiguous()
    num_tokens, hidden = x.shape
    assert weight.shape == (hidden,)
    if quant is None:
        out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
        extra = dict(QUANT=False, S=weight, QMAX=0.0, EPS=0.0, FP8=False)
    else:
        out, scale = empty_rows(num_tokens, hidden, quant, x.device)
        extra = dict(QUANT=True, S=scale, **quant_params(quant))
    res_out = x
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(1) == 1
        assert residual.dtype == x.dtype
        res_out = torch.empty_like(x)
    if num_tokens > 0:
        block = next_pow2(hidden)
        res = residual if residual is not None else x
        _rms_norm_kernel[(num_tokens,)](
            x, res, weight, out, res_out, eps,
            x.stride(0), res.stride(0), out.stride(0), res_out.stride(0),
            N=hidden, BLOCK=block, HAS_RESIDUAL=residual is not None,
            PDL=(pdl := pdl_elementwise(x)), launch_pdl=pdl, num_warps=_num_warps(block), **extra)
    if quant is not None:
        out = (out, scale)
    return out if residual is None else (out, res_out)

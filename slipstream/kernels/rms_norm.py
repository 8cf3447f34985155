"""RMSNorm, optionally fused with the residual add before it, in one kernel.

Hugging Face semantics, rounding step for rounding step (see layers/norm.py):
    s   = x + residual                 (added in the model dtype: rounded once)
    out = weight * (s_fp32 * rsqrt(mean(s_fp32^2) + eps)).to(dtype)
One program normalises one row (token); the whole row is held in registers, so
x, residual and weight are read once and the two outputs written once. The grid
is the number of rows: no host sync, no data-dependent launch, safe to capture
in a CUDA graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from slipstream.kernels.attention_tile import next_pow2


@triton.jit
def _rms_norm_kernel(X, Res, W, Out, ResOut, eps,
                     stride_x, stride_r, stride_o, stride_ro,
                     N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(Res + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(ResOut + row * stride_ro + cols, x, mask=mask)
    h = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(h * h, axis=0) / N + eps)
    normed = (h * inv_rms).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_o + cols, (w * normed).to(Out.dtype.element_ty), mask=mask)


def _num_warps(block: int) -> int:
    return max(1, min(16, block // 256))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x: [num_tokens, hidden]; weight: [hidden] (the model dtype);
    residual: optional [num_tokens, hidden].
    -> normed [num_tokens, hidden], or (normed, x + residual) with a residual."""
    assert x.ndim == 2 and x.stride(1) == 1 and weight.is_contiguous()
    num_tokens, hidden = x.shape
    assert weight.shape == (hidden,)
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    res_out = out
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(1) == 1
        assert residual.dtype == x.dtype
        res_out = torch.empty_like(out)
    if num_tokens > 0:
        block = next_pow2(hidden)
        res = residual if residual is not None else x
        _rms_norm_kernel[(num_tokens,)](
            x, res, weight, out, res_out, eps,
            x.stride(0), res.stride(0), out.stride(0), res_out.stride(0),
            N=hidden, BLOCK=block, HAS_RESIDUAL=residual is not None,
            num_warps=_num_warps(block))
    return out if residual is None else (out, res_out)

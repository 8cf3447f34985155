"""Rotary embedding applied in place to the q and k heads of the fused qkv output.

Reads each token's position, then cos and sin for it straight from the
`RotaryEmbedding` tables (no gathered copy per step or layer), and rotates
every q and k head of that token in place (rotate-half / "neox" convention):
    x1' = x1 cos - x2 sin,   x2' = x2 cos + x1 sin
The tables are [max_position, head_dim] in the model dtype, cos = [c | c] and
signed sin = [-s | s], so the kernel reads the first half of one and the
second half of the other. Rounding follows the torch twin
(`reference.rotary_inplace`): x * cos is rounded to the model dtype, then the
sin term is added and rounded again. The grid depends only on the shape (CUDA
graph safe); positions are read on the device.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from slipstream.kernels.attention_tile import next_pow2


@triton.jit
def _rotary_kernel(QK, Positions, Cos, Sin, stride_t, stride_h, stride_cp,
                   NUM_HEADS: tl.constexpr, HALF: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HALF
    pos = tl.load(Positions + t).to(tl.int64)
    c = tl.load(Cos + pos * stride_cp + d, mask=d_ok, other=0.0).to(tl.float32)
    s = tl.load(Sin + pos * stride_cp + HALF + d, mask=d_ok, other=0.0).to(tl.float32)
    mask = (h < NUM_HEADS)[:, None] & d_ok[None, :]
    ptr1 = QK + t * stride_t + h[:, None] * stride_h + d[None, :]
    x1 = tl.load(ptr1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr1 + HALF, mask=mask, other=0.0).to(tl.float32)
    dtype = QK.dtype.element_ty
    a1 = (x1 * c[None, :]).to(dtype).to(tl.float32)
    a2 = (x2 * c[None, :]).to(dtype).to(tl.float32)
    tl.store(ptr1, (a1 - x2 * s[None, :]).to(dtype), mask=mask)
    tl.store(ptr1 + HALF, (a2 + x1 * s[None, :]).to(dtype), mask=mask)


def rotary_inplace(qk: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor) -> torch.Tensor:
    """qk: [num_tokens, num_heads, head_dim], any token/head strides, last dim
    contiguous (e.g. qkv[:, :heads + kv_heads]); positions: [num_tokens] int;
    cos, sin: [max_position, head_dim] tables ([c | c], [-s | s]).
    Rotates qk in place and returns it."""
    num_tokens, num_heads, head_dim = qk.shape
    assert qk.stride(2) == 1 and head_dim % 2 == 0
    assert cos.shape == sin.shape and cos.shape[1] == head_dim and cos.stride() == sin.stride()
    assert cos.stride(1) == 1 and positions.shape == (num_tokens,)
    if num_tokens == 0:
        return qk
    half = head_dim // 2
    block_h = min(next_pow2(num_heads), 16)
    _rotary_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
        qk, positions, cos, sin, qk.stride(0), qk.stride(1), cos.stride(0),
        NUM_HEADS=num_heads, HALF=half, BLOCK_H=block_h, BLOCK_D=next_pow2(half), num_warps=4)
    return qk

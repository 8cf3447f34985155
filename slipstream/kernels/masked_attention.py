"""Attention of a few query rows under an explicit boolean mask: the EAGLE head's
attention while it drafts (spec/eagle_head.py), a beam of 8 rows or the 7 pairs
after a round, over a static past of a few hundred keys of which a prefix is real,
plus the draft tree's own keys.

SDPA runs that on the H200 as cuDNN's kernel, ~9-10 us a call after a memset, with
K/V first repeated for the query heads (GQA). Here one launch: a program per (KV
head, block of rows), the rows being (query token, head of the KV group), so each K/V
tile is read once for the whole group; online softmax over tiles of keys, the mask
read tile by tile. Every query row must see at least one key (the head's rows see
themselves).

Twin: `masked_attention_reference` (SDPA on the same inputs, GQA expanded).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from slipstream.kernels.attention_tile import LOG2E, exact_dot, next_pow2, softmax_tile_update
from slipstream.kernels.runtime import interpreting


@triton.jit
def _masked_attention_kernel(Q, K, V, Mask, Out, T, C, stride_qt, stride_qh, stride_kc,
                             stride_kh, stride_vc, stride_vh, stride_mt, stride_ot, stride_oh,
                             qk_scale, GROUP: tl.constexpr, D: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, F32: tl.constexpr):
    kvh = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    t = rows // GROUP
    head = kvh * GROUP + rows % GROUP
    row_ok = t < T
    d = tl.arange(0, D)
    q = tl.load(Q + t[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)
    if F32:  # (the interpreter's bf16 dots are wrong)
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for c0 in range(0, C, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)
        col_ok = cols < C
        k = tl.load(K + cols[:, None] * stride_kc + kvh * stride_kh + d[None, :],
                    mask=col_ok[:, None], other=0.0)
        v = tl.load(V + cols[:, None] * stride_vc + kvh * stride_vh + d[None, :],
                    mask=col_ok[:, None], other=0.0)
        seen = tl.load(Mask + t[:, None] * stride_mt + cols[None, :],
                       mask=row_ok[:, None] & col_ok[None, :], other=0)
        if F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        # A row's masked keys score MASKED_SCORE: wiped by its first seen key.
        acc, m_i, l_i = softmax_tile_update(acc, m_i, l_i, exact_dot(q, tl.trans(k)), v,
                                            qk_scale, seen != 0, True)
    tl.store(Out + t[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             (acc / l_i[:, None]).to(Out.dtype.element_ty), mask=row_ok[:, None])


def supported(head_dim: int) -> bool:
    """Head dims the kernel takes: powers of two, 16-256."""
    return 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scale: float | None = None) -> torch.Tensor:
    """q [T, heads, d], k / v [C, kv_heads, d] (last dim contiguous), mask [T, C] bool
    (True: row t sees key c; every row sees one at least) -> [T, heads, d] in q's dtype.
    d a power of two (16-256)."""
    t, heads, d = q.shape
    c, kv_heads, _ = k.shape
    if heads % kv_heads or not supported(d) or mask.shape != (t, c):
        raise ValueError(f"masked_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"mask {tuple(mask.shape)}")
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    if mask.dtype != torch.bool or mask.stride(1) != 1:
        mask = mask.to(torch.bool).contiguous()
    group = heads // kv_heads
    out = torch.empty_like(q)
    block_m = max(16, min(64, next_pow2(t * group)))
    grid = (kv_heads, triton.cdiv(t * group, block_m))
    _masked_attention_kernel[grid](
        q, k, v, mask.view(torch.uint8), out, t, c, q.stride(0), q.stride(1), k.stride(0),
        k.stride(1), v.stride(0), v.stride(1), mask.stride(0), out.stride(0), out.stride(1),
        (d ** -0.5 if scale is None else scale) * LOG2E, GROUP=group, D=d, BLOCK_M=block_m,
        BLOCK_N=64, F32=interpreting(), num_warps=4, num_stages=3)
    return out


def masked_attention_reference(q, k, v, mask, scale: float | None = None) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(group, dim=1) for x in (k, v))
    o = F.scaled_dot_product_attention(q.transpose(0, 1).float(), k.transpose(0, 1).float(),
                                       v.transpose(0, 1).float(), attn_mask=mask, scale=scale)
    return o.transpose(0, 1)                      # fp32


@torch.library.custom_op("slipstream::masked_attention", mutates_args=())
def masked_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        mask: torch.Tensor) -> torch.Tensor:
    """masked_attention as one opaque op for torch.compile'd callers."""
    return masked_attention(q, k, v, mask)


@masked_attention_op.register_fake
def _(q, k, v, mask):
    return torch.empty_like(q)

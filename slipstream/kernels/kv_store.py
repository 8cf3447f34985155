"""KV store: write the step's new keys and values into the paged cache.

One program per token copies all of its KV heads (a few KB) to slot
`slot_mapping[t]` = block * page_size + offset, casting to the cache dtype;
a slot of -1 (a padding token) is skipped. On Hopper it lets the kernel after
it (the decode attention) launch at once; that kernel waits for this one before
it reads the cache (programmatic dependent launch, see decode_attention.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton.language.extra.cuda import gdc_launch_dependents

from slipstream.kernels.attention_tile import next_pow2
from slipstream.kernels.runtime import pdl_supported


@triton.jit
def _store_kv_kernel(K, V, KCache, VCache, SlotMapping,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cb, stride_cs, stride_ch,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     HEADS_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr,
                     PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(SlotMapping + t)
    if slot < 0:
        return
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    mask = (h < NUM_KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
    dst = (slot // PAGE_SIZE) * stride_cb + (slot % PAGE_SIZE) * stride_cs + h[:, None] * stride_ch + d[None, :]
    k = tl.load(K + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    tl.store(KCache + dst, k.to(KCache.dtype.element_ty), mask=mask)
    v = tl.load(V + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    tl.store(VCache + dst, v.to(VCache.dtype.element_ty), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: [num_tokens, num_kv_heads, head_dim]; k_cache, v_cache: [num_blocks,
    page_size, num_kv_heads, head_dim]; slot_mapping: [num_tokens] int64 (-1 skips)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k.stride(2) == 1 and v.stride(2) == 1 and k_cache.stride(3) == 1
    assert k_cache.stride() == v_cache.stride() and k_cache.shape[2:] == k.shape[1:]
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HEADS_PAD=next_pow2(num_kv_heads),
        HEAD_DIM_PAD=next_pow2(head_dim), PAGE_SIZE=k_cache.shape[1], PDL=pdl_supported(k),
        num_warps=4)

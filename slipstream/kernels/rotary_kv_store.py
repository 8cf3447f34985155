"""Rotary embedding and KV store in one kernel.

A layer's attention input otherwise takes two small kernels a step: the rotary
kernel rotates the q and k heads in place (kernels/rotary.py), then the KV
store copies k and v into the paged cache (kernels/kv_store.py); at decode
each is a launch and a few KB. Here program (token, j) does both: for j below
the q-head blocks it rotates BLOCK_H query heads in place; the last program of
the token rotates the token's k heads in place, and writes those rotated keys
and the values to cache slot `slot_mapping[t]` (skipped when -1), quantized
with one scale per (token, head) when the cache holds int8 / fp8 codes.

Rounding is that of the two kernels in sequence (their torch twins:
`reference.rotary_inplace` then `reference.store_kv`): x * cos rounded to the
model dtype, the sin term added and rounded again, and the cache gets the
rounded keys. k is still rotated in place, since the prefill kernel reads the
step's keys from it. On Hopper the kernel lets the attention kernel after it
launch at once (programmatic dependent launch); that kernel waits for this one
before it reads the query or the cache. The grid depends only on the token and
head counts, so the kernel can be captured in a CUDA graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from slipstream.kernels.attention_tile import next_pow2
from slipstream.kernels.kv_store import codes_of, scale_pool_args
from slipstream.kernels.runtime import pdl_elementwise, pdl_supported


@triton.jit
def _rotate_halves(x1, x2, c, s, dtype: tl.constexpr):
    """The rotated halves of heads x = [x1 | x2] (fp32), rounded as the rotary kernel."""
    a1 = (x1 * c[None, :]).to(dtype).to(tl.float32)
    a2 = (x2 * c[None, :]).to(dtype).to(tl.float32)
    return (a1 - x2 * s[None, :]).to(dtype), (a2 + x1 * s[None, :]).to(dtype)


@triton.jit
def _rotate_q_heads(Q, t, j, c, s, d, d_ok, stride_qt, stride_qh, NUM_HEADS: tl.constexpr,
                    HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    """Query heads [j * BLOCK_H, (j + 1) * BLOCK_H) of token t, in place."""
    h = j * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (h < NUM_HEADS)[:, None] & d_ok[None, :]
    ptr = Q + t * stride_qt + h[:, None] * stride_qh + d[None, :]
    x1 = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    r1, r2 = _rotate_halves(x1, x2, c, s, Q.dtype.element_ty)
    tl.store(ptr, r1, mask=mask)
    tl.store(ptr + HALF, r2, mask=mask)


@triton.jit
def _rotate_store_kv(K, V, KCache, VCache, KScale, VScale, SlotMapping, t, c, s, d, d_ok,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cb, stride_cs, stride_ch, stride_sb, stride_ss,
                     NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr, KV_PAD: tl.constexpr,
                     PAGE_SIZE: tl.constexpr, QUANT: tl.constexpr, QMAX: tl.constexpr,
                     IS_INT: tl.constexpr):
    """Token t's k heads rotated in place, then its k and v into the cache."""
    h = tl.arange(0, KV_PAD)
    h_ok = h < NUM_KV_HEADS
    mask = h_ok[:, None] & d_ok[None, :]
    k_ptr = K + t * stride_kt + h[:, None] * stride_kh + d[None, :]
    v_ptr = V + t * stride_vt + h[:, None] * stride_vh + d[None, :]
    x1 = tl.load(k_ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(k_ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    v1 = tl.load(v_ptr, mask=mask, other=0.0).to(tl.float32)
    v2 = tl.load(v_ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    k1, k2 = _rotate_halves(x1, x2, c, s, K.dtype.element_ty)
    tl.store(k_ptr, k1, mask=mask)
    tl.store(k_ptr + HALF, k2, mask=mask)
    slot = tl.load(SlotMapping + t)
    if slot >= 0:
        page, off = slot // PAGE_SIZE, slot % PAGE_SIZE
        dst = page * stride_cb + off * stride_cs + h[:, None] * stride_ch + d[None, :]
        c1, c2 = k1.to(tl.float32), k2.to(tl.float32)
        if QUANT:  # one scale per head over both halves (kv_store.py's rounding)
            k_s = tl.maximum(tl.maximum(tl.max(tl.abs(c1), 1), tl.max(tl.abs(c2), 1)) / QMAX,
                             1e-10)
            v_s = tl.maximum(tl.maximum(tl.max(tl.abs(v1), 1), tl.max(tl.abs(v2), 1)) / QMAX,
                             1e-10)
            c1, c2 = codes_of(c1, k_s, QMAX, IS_INT), codes_of(c2, k_s, QMAX, IS_INT)
            v1, v2 = codes_of(v1, v_s, QMAX, IS_INT), codes_of(v2, v_s, QMAX, IS_INT)
            s_dst = page * stride_sb + off * stride_ss + h
            tl.store(KScale + s_dst, k_s, mask=h_ok)
            tl.store(VScale + s_dst, v_s, mask=h_ok)
        cdt = KCache.dtype.element_ty
        tl.store(KCache + dst, c1.to(cdt), mask=mask)
        tl.store(KCache + dst + HALF, c2.to(cdt), mask=mask)
        tl.store(VCache + dst, v1.to(cdt), mask=mask)
        tl.store(VCache + dst + HALF, v2.to(cdt), mask=mask)


@triton.jit
def _rotary_store_kernel(Q, K, V, Positions, Cos, Sin, KCache, VCache, KScale, VScale,
                         SlotMapping, stride_qt, stride_qh, stride_kt, stride_kh,
                         stride_vt, stride_vh, stride_cp,
                         stride_cb, stride_cs, stride_ch, stride_sb, stride_ss,
                         NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                         HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
                         KV_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr, QUANT: tl.constexpr,
                         QMAX: tl.constexpr, IS_INT: tl.constexpr, PDL: tl.constexpr,
                         EARLY: tl.constexpr):
    if PDL:  # the attention kernel may launch; it waits for this grid before its reads
        gdc_launch_dependents()
    if EARLY:  # launched early itself: q, k and v are the kernel ahead's outputs
        gdc_wait()
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HALF
    pos = tl.load(Positions + t).to(tl.int64)
    c = tl.load(Cos + pos * stride_cp + d, mask=d_ok, other=0.0).to(tl.float32)
    s = tl.load(Sin + pos * stride_cp + HALF + d, mask=d_ok, other=0.0).to(tl.float32)
    if j < tl.cdiv(NUM_HEADS, BLOCK_H):
        _rotate_q_heads(Q, t, j, c, s, d, d_ok, stride_qt, stride_qh, NUM_HEADS, HALF, BLOCK_H)
    else:
        _rotate_store_kv(K, V, KCache, VCache, KScale, VScale, SlotMapping, t, c, s, d, d_ok,
                         stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_cs,
                         stride_ch, stride_sb, stride_ss, NUM_KV_HEADS, HALF, KV_PAD, PAGE_SIZE,
                         QUANT, QMAX, IS_INT)


def rotary_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                    cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                    k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> None:
    """Rotate q and k in place and write the rotated k and v into the paged cache.

    q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
    (strided views of the qkv output allowed; last dim contiguous); positions:
    [num_tokens] int; cos, sin: [max_position, head_dim] tables ([c | c], [-s | s],
    layers/rotary.py); k_cache, v_cache: [num_blocks, page_size, num_kv_heads,
    head_dim]; slot_mapping: [num_tokens] int64 (-1 skips the store); k_scale,
    v_scale: [num_blocks, page_size, num_kv_heads] fp32 for an int8 / fp8 cache.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if head_dim % 2:
        raise ValueError(f"rotary needs an even head_dim, got {head_dim}")
    if k.shape != (num_tokens, num_kv_heads, head_dim) or v.shape != k.shape:
        raise ValueError(f"k and v must be [{num_tokens}, kv_heads, {head_dim}], got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1 and k.dtype == q.dtype
    assert cos.shape == sin.shape and cos.shape[1] == head_dim and cos.stride() == sin.stride()
    assert cos.stride(1) == 1 and positions.shape == (num_tokens,)
    assert k_cache.stride(3) == 1 and k_cache.stride() == v_cache.stride()
    assert k_cache.shape[2:] == k.shape[1:]
    if num_tokens == 0:
        return
    quant, qmax, is_int, scales, s_strides = scale_pool_args(k_cache, v_cache, k_scale, v_scale)
    half = head_dim // 2
    block_h = min(next_pow2(num_heads), 16)
    _rotary_store_kernel[(num_tokens, triton.cdiv(num_heads, block_h) + 1)](
        q, k, v, positions, cos, sin, k_cache, v_cache, *scales, slot_mapping,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), *s_strides,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HALF=half, BLOCK_D=next_pow2(half),
        BLOCK_H=block_h, KV_PAD=next_pow2(num_kv_heads), PAGE_SIZE=k_cache.shape[1],
        QUANT=quant, QMAX=qmax, IS_INT=is_int, PDL=pdl_supported(q),
        EARLY=(early := pdl_elementwise(q)), launch_pdl=early, num_warps=4)

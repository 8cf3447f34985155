"""KV store: write the step's new keys and values into the paged cache.

One program per token copies all of its KV heads (a few KB) to slot
`slot_mapping[t]` = block * page_size + offset, casting to the cache dtype;
a slot of -1 (a padding token) is skipped. On Hopper it lets the kernel after
it (the decode attention) launch at once; that kernel waits for this one before
it reads the cache (programmatic dependent launch, see decode_attention.py).

A quantized cache (int8 or fp8 e4m3 codes, quant/kv_quant.py) is written with
one scale per (token, head), max |x| / QMAX over the head's dim, stored in the
scale pools beside the codes; int8 codes round half away from zero, fp8 codes to
nearest even. (fp8: the value is first rounded to 3 mantissa bits in fp32, so
the conversion itself is exact for normal values; Triton's interpreter
mis-rounds conversions whose mantissa carries into the exponent.)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton.language.extra.cuda import gdc_launch_dependents

from slipstream.kernels.attention_tile import next_pow2
from slipstream.kernels.runtime import pdl_supported


@triton.jit
def _quantize_rows(x, QMAX: tl.constexpr, IS_INT: tl.constexpr):
    """x: [H, D] fp32 -> (codes [H, D] fp32 holding exact code values, scale [H])."""
    scale = tl.maximum(tl.max(tl.abs(x), 1) / QMAX, 1e-10)
    return codes_of(x, scale, QMAX, IS_INT), scale


@triton.jit
def codes_of(x, scale, QMAX: tl.constexpr, IS_INT: tl.constexpr):
    """x: [H, D] fp32, scale: [H] (max |x| / QMAX of each row, at least 1e-10) ->
    codes [H, D] fp32 holding exact code values."""
    y = x / scale[:, None]
    if IS_INT:
        y = tl.minimum(tl.maximum(tl.where(y >= 0, tl.floor(y + 0.5), -tl.floor(0.5 - y)),
                                  -QMAX), QMAX)
    else:  # round to nearest even at 3 mantissa bits (fp32 bits 20..0 dropped)
        y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
        bits = y.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000
        y = bits.to(tl.float32, bitcast=True)
    return y


@triton.jit
def _store_kv_kernel(K, V, KCache, VCache, KScale, VScale, SlotMapping,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cb, stride_cs, stride_ch, stride_sb, stride_ss,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     HEADS_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr,
                     QUANT: tl.constexpr, QMAX: tl.constexpr, IS_INT: tl.constexpr,
                     PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(SlotMapping + t)
    if slot < 0:
        return
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    h_ok = h < NUM_KV_HEADS
    mask = h_ok[:, None] & (d < HEAD_DIM)[None, :]
    page, off = slot // PAGE_SIZE, slot % PAGE_SIZE
    dst = page * stride_cb + off * stride_cs + h[:, None] * stride_ch + d[None, :]
    k = tl.load(K + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask, other=0.0)
    v = tl.load(V + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask, other=0.0)
    if QUANT:
        k, k_scale = _quantize_rows(k.to(tl.float32), QMAX, IS_INT)
        v, v_scale = _quantize_rows(v.to(tl.float32), QMAX, IS_INT)
        s_dst = page * stride_sb + off * stride_ss + h
        tl.store(KScale + s_dst, k_scale, mask=h_ok)
        tl.store(VScale + s_dst, v_scale, mask=h_ok)
    tl.store(KCache + dst, k.to(KCache.dtype.element_ty), mask=mask)
    tl.store(VCache + dst, v.to(VCache.dtype.element_ty), mask=mask)


def scale_pool_args(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None,
                    v_scale: torch.Tensor | None) -> tuple:
    """What a store kernel needs of the scale pools: (quantized?, the code format's qmax,
    int codes?, (k, v) scale tensors or placeholders, their block and page strides)."""
    quant = k_scale is not None
    qmax, is_int = 0.0, False
    if quant:
        from slipstream.quant.kv_quant import kv_format_of
        fmt = kv_format_of(k_cache.dtype)
        qmax, is_int = fmt.qmax, fmt.storage == torch.int8
        assert k_scale.stride() == v_scale.stride() and k_scale.stride(2) == 1
        assert k_scale.dtype == torch.float32 and k_scale.shape == k_cache.shape[:3]
    scales = (k_scale, v_scale) if quant else (k_cache, v_cache)
    s_strides = (k_scale.stride(0), k_scale.stride(1)) if quant else (0, 0)
    return quant, qmax, is_int, scales, s_strides


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """k, v: [num_tokens, num_kv_heads, head_dim]; k_cache, v_cache: [num_blocks,
    page_size, num_kv_heads, head_dim]; slot_mapping: [num_tokens] int64 (-1 skips).
    k_scale, v_scale: [num_blocks, page_size, num_kv_heads] fp32 when the cache
    holds int8 / fp8 codes (quantized here), else None."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k.stride(2) == 1 and v.stride(2) == 1 and k_cache.stride(3) == 1
    assert k_cache.stride() == v_cache.stride() and k_cache.shape[2:] == k.shape[1:]
    quant, qmax, is_int, scales, s_strides = scale_pool_args(k_cache, v_cache, k_scale, v_scale)
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, *scales, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), *s_strides,
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HEADS_PAD=next_pow2(num_kv_heads),
        HEAD_DIM_PAD=next_pow2(head_dim), PAGE_SIZE=k_cache.shape[1], QUANT=quant, QMAX=qmax,
        IS_INT=is_int, PDL=pdl_supported(k), num_warps=4)

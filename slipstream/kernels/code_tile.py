"""Jit building blocks: attention over a quantized cache with fp16 / int8 operands.

The decode loop over 1-byte codes (int8 / fp8 e4m3, one fp32 scale per token
and head) that converts the codes to the query's dtype (attention_tile.py,
QUANT) compiles on sm_90 to 2.5x the instructions a key of the bf16 loop
(benchmarks/quant/kv_decode_sass.py): the int8 -> bf16 bit trick costs two
instructions a code, e4m3 -> bf16 a quarter-rate f16 -> bf16 convert a code,
and V's keys, which the P.V dot needs packed in pairs, are gathered one byte a
shared-memory load. With half the bytes to move, the loop is then no faster
than the bf16 one. This path cuts those instructions:

* fp16 operands. int8 codes become fp16 in inline PTX at five instructions for
  four (the code + 128 ORed into the mantissa of 1024, minus 1152), e4m3 codes
  by the native e4m3x2 -> f16x2 convert. The query rows are scaled by powers
  of two into [1, 4) before they turn fp16 (exact for a bf16 query: no bits
  lost, no overflow), and the factor returns with K's per-token scale on the
  score. P times V's scales is divided by the tile's largest V scale before it
  turns fp16, so small scales never sink into fp16's subnormals; the factor
  multiplies the tile's P.V product.
* V read as 16-bit words (V_PAIRS): each word holds channels 2j and 2j + 1 of a
  key, so V is two [N, D/2] 16-bit operands that load with the transposing
  ldmatrix, no byte gathers; two dots, and the halves are interleaved once,
  after the loop.
* int8 K unconverted (K_INT, int8 caches): the query is split into two int8
  tensors, q ~ u * (254 hi + lo) (to 1/64516 of the row's peak, finer than
  bf16's 1/256 an element), and q.k is two int8 tensor-core dots with exact
  int32 sums.

Exact up to the fp16 rounding of P (11 bits; the bf16 path keeps 8) and, with
K_INT, the query's split.
"""
from __future__ import annotations

import triton
import triton.language as tl

from slipstream.kernels.attention_tile import paged_tile_mask, tile_pages


@triton.jit
def fp16_query(q):
    """q: [M, D] 16-bit or fp32 -> (fp16 [M, D] whose rows peak in [1, 4),
    unscale [M] fp32: the power of two that undoes it)."""
    qf = q.to(tl.float32)
    amax = tl.max(tl.abs(qf), 1)
    e = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF   # biased exponent of the row's peak
    e = tl.minimum(tl.maximum(e, 1), 253)
    scale = ((254 - e) << 23).to(tl.float32, bitcast=True)    # 2^(127 - e)
    unscale = (e << 23).to(tl.float32, bitcast=True)          # 2^(e - 127)
    return (qf * scale[:, None]).to(tl.float16), unscale


@triton.jit
def int8_query(q):
    """q: [M, D] -> (hi, lo: int8 [M, D], unscale [M] fp32) with
    q ~ unscale * (254 * hi + lo), to 1/64516 of the row's peak: the score
    q.k of int8 codes is then two int8 tensor-core dots, the codes unconverted."""
    qf = q.to(tl.float32)
    step = tl.maximum(tl.max(tl.abs(qf), 1), 1.0e-30) / 127.0
    x = qf / step[:, None]                       # [-127, 127]
    hi = tl.floor(x + 0.5)
    lo = tl.floor((x - hi) * 254.0 + 0.5)        # [-127, 127]
    return hi.to(tl.int8), lo.to(tl.int8), step / 254.0


@triton.jit
def _biased_to_f16(b):
    """uint16 holding code + 128 (0..255) -> fp16 code: OR it into the mantissa
    of 1024 (one bit op), take away 1152 (a packed fp16 add): exact."""
    return (b | 0x6400).to(tl.float16, bitcast=True) - 1152.0


@triton.jit
def _codes_to_f16(x, ASM: tl.constexpr):
    """1-byte codes (int8 or fp8e4nv) -> fp16, exact. int8 through `.to` is an
    int -> float convert, a quarter-rate instruction on sm_90; the bit trick in
    Triton ops costs six instructions for two codes (unpacked bytes), in PTX
    five for four. e4m3 -> fp16 is a native convert of two codes."""
    if x.dtype == tl.int8:
        if ASM:
            return tl.inline_asm_elementwise(
                asm="""{
                .reg .b32 t, m;
                mov.b32 m, 0x64806480;
                xor.b32 t, $2, 0x80808080;
                prmt.b32 $0, t, 0x64646464, 0x4140;
                prmt.b32 $1, t, 0x64646464, 0x4342;
                sub.f16x2 $0, $0, m;
                sub.f16x2 $1, $1, m;
                }""", constraints="=r,=r,r", args=[x], dtype=tl.float16, is_pure=True, pack=4)
        return _biased_to_f16((x.to(tl.uint8, bitcast=True) ^ 0x80).to(tl.uint16))
    else:
        return x.to(tl.float16)


@triton.jit
def _words_to_f16(w, INT8: tl.constexpr, ASM: tl.constexpr):
    """int16 words of two 1-byte codes (channel 2j low, 2j + 1 high) -> the
    fp16 codes of channels 2j and 2j + 1, exact."""
    if ASM:
        if INT8:   # two words a register: bytes 0, 2 are even channels, 1, 3 odd
            return tl.inline_asm_elementwise(
                asm="""{
                .reg .b32 t, m;
                mov.b32 m, 0x64806480;
                xor.b32 t, $2, 0x80808080;
                prmt.b32 $0, t, 0x64646464, 0x4240;
                prmt.b32 $1, t, 0x64646464, 0x4341;
                sub.f16x2 $0, $0, m;
                sub.f16x2 $1, $1, m;
                }""", constraints="=r,=r,r", args=[w], dtype=(tl.float16, tl.float16),
                is_pure=True, pack=2)
        else:
            return tl.inline_asm_elementwise(
                asm="""{
                .reg .b32 t;
                .reg .b16 e, o;
                prmt.b32 t, $2, 0, 0x3120;
                mov.b32 {e, o}, t;
                cvt.rn.f16x2.e4m3x2 $0, e;
                cvt.rn.f16x2.e4m3x2 $1, o;
                }""", constraints="=r,=r,r", args=[w], dtype=(tl.float16, tl.float16),
                is_pure=True, pack=2)
    if INT8:
        wb = w.to(tl.uint16, bitcast=True) ^ 0x8080       # both codes + 128
        return _biased_to_f16(wb & 0xFF), _biased_to_f16(wb >> 8)
    else:
        lo = (w & 0xFF).to(tl.int8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        hi = (w >> 8).to(tl.int8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        return lo, hi


@triton.jit
def load_code_tile(KCache, VCache, KScale, VScale, block_table_row, start, kv_head, key_end,
                   stride_cb, stride_cs, stride_ch, stride_sb, stride_ss,
                   HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
                   MASKED: tl.constexpr, V_PAIRS: tl.constexpr, ASM: tl.constexpr,
                   K_INT: tl.constexpr):
    """Cached tokens [start, start + BLOCK_N) of one KV head as fp16: K^T [D, N],
    and V as [N, D] or (V_PAIRS) its even and odd channels [N, D/2] each; the
    per-token scales [N], [N] (0 past key_end when MASKED). K_INT: K stays int8."""
    pos = start + tl.arange(0, BLOCK_N)
    key_ok = pos < key_end
    page = tile_pages(block_table_row, start, pos, key_ok, BLOCK_N, PAGE_SIZE, MASKED)
    slot = page * stride_cb + (pos % PAGE_SIZE) * stride_cs + kv_head * stride_ch
    offs_d = tl.arange(0, HEAD_DIM)
    s_offs = page * stride_sb + (pos % PAGE_SIZE) * stride_ss + kv_head
    if MASKED:
        k = tl.load(KCache + slot[None, :] + offs_d[:, None], mask=key_ok[None, :], other=0.0)
        k_scale = tl.load(KScale + s_offs, mask=key_ok, other=0.0)
        v_scale = tl.load(VScale + s_offs, mask=key_ok, other=0.0)
    else:
        k = tl.load(KCache + slot[None, :] + offs_d[:, None])
        k_scale = tl.load(KScale + s_offs)
        v_scale = tl.load(VScale + s_offs)
    if not K_INT:
        k = _codes_to_f16(k, ASM)
    if V_PAIRS:
        # Offsets in words: every stride and the head dim are even.
        offs_w = tl.arange(0, HEAD_DIM // 2)
        words = VCache.to(tl.pointer_type(tl.int16))
        wslot = page * (stride_cb // 2) + (pos % PAGE_SIZE) * (stride_cs // 2) + kv_head * (stride_ch // 2)
        if MASKED:
            w = tl.load(words + wslot[:, None] + offs_w[None, :], mask=key_ok[:, None], other=0.0)
        else:
            w = tl.load(words + wslot[:, None] + offs_w[None, :])
        v_lo, v_hi = _words_to_f16(w, VCache.dtype.element_ty == tl.int8, ASM)
        return k, v_lo, v_hi, k_scale, v_scale
    else:
        if MASKED:
            v = tl.load(VCache + slot[:, None] + offs_d[None, :], mask=key_ok[:, None], other=0.0)
        else:
            v = tl.load(VCache + slot[:, None] + offs_d[None, :])
        v = _codes_to_f16(v, ASM)
        return k, v, v, k_scale, v_scale


@triton.jit
def attend_code_keys(acc_a, acc_b, m_i, l_i, q16, q_lo, q_unscale, KCache, VCache, KScale, VScale,
                     block_table_row, kv_head, lo, hi, key_end, q_pos, window, qk_scale,
                     stride_cb, stride_cs, stride_ch, stride_sb, stride_ss, tree_bits, step_start,
                     HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
                     CAUSAL: tl.constexpr, SLIDING: tl.constexpr, TREE: tl.constexpr,
                     MASKED: tl.constexpr, V_PAIRS: tl.constexpr, ASM: tl.constexpr,
                     K_INT: tl.constexpr):
    """attention_tile.attend_paged_keys over codes with fp16 operands.

    q16, q_unscale: from `fp16_query`, or with K_INT (int8 cache) q16, q_lo,
    q_unscale from `int8_query` (q_lo unread without K_INT). acc_a, acc_b: [M, D/2] fp32 accumulators
    of the even and odd channels with V_PAIRS, else acc_a [M, D] (acc_b unused).
    """
    for start in tl.range(lo, hi, BLOCK_N):
        start = tl.multiple_of(start, BLOCK_N)
        k, v_a, v_b, k_scale, v_scale = load_code_tile(
            KCache, VCache, KScale, VScale, block_table_row, start, kv_head, key_end,
            stride_cb, stride_cs, stride_ch, stride_sb, stride_ss, HEAD_DIM, BLOCK_N, PAGE_SIZE,
            MASKED, V_PAIRS, ASM, K_INT)
        if K_INT:   # exact int32 sums: |254 hi.k + lo.k| < 2^30
            s = tl.dot(q16, k, out_dtype=tl.int32) * 254
            qk = tl.dot(q_lo, k, s, out_dtype=tl.int32).to(tl.float32) * k_scale[None, :]
        else:
            qk = tl.dot(q16, k) * k_scale[None, :]
        row_scale = q_unscale * qk_scale   # > 0: the query's power of two x softmax scale
        if MASKED:
            mask = paged_tile_mask(start, key_end, q_pos, window, tree_bits, step_start, BLOCK_N,
                                   CAUSAL, SLIDING, TREE)
            qk = tl.where(mask, qk * row_scale[:, None], -1.0e6)
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.math.exp2(qk - m_new[:, None])
        else:   # one fused multiply-add a score
            m_new = tl.maximum(m_i, tl.max(qk, 1) * row_scale)
            p = tl.math.exp2(qk * row_scale[:, None] - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
        # P x V's scales, brought to at most 1 by the tile's largest scale (masked: 0).
        v_peak = tl.maximum(tl.max(v_scale, 0), 1.0e-30)
        p16 = (p * (v_scale * (1.0 / v_peak))[None, :]).to(tl.float16)
        acc_a = acc_a * alpha[:, None] + tl.dot(p16, v_a) * v_peak
        if V_PAIRS:
            acc_b = acc_b * alpha[:, None] + tl.dot(p16, v_b) * v_peak
    return acc_a, acc_b, m_i, l_i


@triton.jit
def attend_code_range(q16, q_lo, q_unscale, KCache, VCache, KScale, VScale, block_table_row, kv_head,
                      lo, clean_end, hi, key_end, q_pos, window, qk_scale,
                      stride_cb, stride_cs, stride_ch, stride_sb, stride_ss, tree_bits, step_start,
                      BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                      PAGE_SIZE: tl.constexpr, CAUSAL: tl.constexpr, SLIDING: tl.constexpr,
                      TREE: tl.constexpr, V_PAIRS: tl.constexpr, ASM: tl.constexpr,
                      K_INT: tl.constexpr):
    """attention_tile.attend_paged_range over codes from fresh state:
    (acc [M, D] fp32 unnormalised, m [M], l [M])."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if V_PAIRS:
        acc_a = tl.zeros([BLOCK_M, HEAD_DIM // 2], tl.float32)
        acc_b = tl.zeros([BLOCK_M, HEAD_DIM // 2], tl.float32)
    else:
        acc_a = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        acc_b = tl.zeros([BLOCK_M, 2], tl.float32)
    acc_a, acc_b, m_i, l_i = attend_code_keys(
        acc_a, acc_b, m_i, l_i, q16, q_lo, q_unscale, KCache, VCache, KScale, VScale, block_table_row,
        kv_head, lo, clean_end, key_end, q_pos, window, qk_scale, stride_cb, stride_cs, stride_ch,
        stride_sb, stride_ss, tree_bits, step_start, HEAD_DIM, BLOCK_N, PAGE_SIZE, CAUSAL,
        SLIDING, TREE, False, V_PAIRS, ASM, K_INT)
    acc_a, acc_b, m_i, l_i = attend_code_keys(
        acc_a, acc_b, m_i, l_i, q16, q_lo, q_unscale, KCache, VCache, KScale, VScale, block_table_row,
        kv_head, clean_end, hi, key_end, q_pos, window, qk_scale, stride_cb, stride_cs, stride_ch,
        stride_sb, stride_ss, tree_bits, step_start, HEAD_DIM, BLOCK_N, PAGE_SIZE, CAUSAL,
        SLIDING, TREE, True, V_PAIRS, ASM, K_INT)
    if V_PAIRS:   # channel j of the halves is channel 2j / 2j + 1
        acc = tl.reshape(tl.join(acc_a, acc_b), [BLOCK_M, HEAD_DIM])
    else:
        acc = acc_a
    return acc, m_i, l_i

"""Jit building blocks shared by the attention kernels.

Every kernel here is the same loop (FlashAttention-2, chapter 2.2/2.5): keep a
tile of queries on chip, stream K/V tiles past it, and fold each tile into a
running max `m`, running sum `l` and unnormalised output `acc` (the online
softmax); the division by `l` waits until the end. Scores live in the log2
domain (`qk_scale` = softmax scale * log2(e)) so the exponentials are exp2.

Masked scores are set to -1e6 rather than -inf: a row whose first tile is fully
masked then gets finite garbage that the next real tile wipes out (its rescale
factor exp2(-1e6 - m) is 0), instead of NaN from (-inf) - (-inf). Every valid
query row sees at least its own key, so the garbage never survives.

Quantized caches (QUANT: int8 or fp8 e4m3 codes with one fp32 scale per token
and head, quant/kv_quant.py): the codes are converted to the query dtype in
registers (exact: |int8| <= 127 and e4m3 fit bf16/fp16), K's scale multiplies
the score column q.k_j after the dot and V's multiplies the probability p_j
before the P.V dot, so no dequantized tile is ever materialised.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MASKED_SCORE = -1.0e6
LOG2E = 1.4426950408889634   # scores go to exp2: scale * LOG2E


@triton.jit
def exact_dot(a, b, acc=None):
    """tl.dot, but fp32 operands multiply in full fp32 (Triton's default for
    them is tf32, about 1e-3 relative error), so an fp32 engine stays exact."""
    if a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def softmax_tile_update(acc, m_i, l_i, qk, v, qk_scale, mask, MASKED: tl.constexpr,
                        v_scale=1.0, V_SCALED: tl.constexpr = False):
    """Fold one tile of raw scores into the running softmax state.

    acc: [M, D] fp32, m_i / l_i: [M] fp32 (log2 domain), qk: [M, N] raw q.k,
    v: [N, D], mask: [M, N] bool (read only when MASKED), v_scale: [N] fp32
    per-key scales of quantized values (read only when V_SCALED).
    """
    if MASKED:
        qk = tl.where(mask, qk * qk_scale, -1.0e6)
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        qk = qk - m_new[:, None]
    else:
        # One fused multiply-add per score instead of a multiply then a subtract.
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        qk = qk * qk_scale - m_new[:, None]
    p = tl.math.exp2(qk)
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if V_SCALED:
        p = p * v_scale[None, :]
    acc = exact_dot(p.to(v.dtype), v, acc)
    return acc, m_new, l_i


@triton.jit
def tile_pages(block_table_row, start, pos, key_ok, BLOCK_N: tl.constexpr,
               PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr):
    """The cache block of each position of the tile [start, start + BLOCK_N) (int64):
    one scalar block-table read when a page holds the tile (start is a multiple of
    BLOCK_N), else one a position (masked reads past key_end when MASKED)."""
    if PAGE_SIZE >= BLOCK_N:
        return tl.load(block_table_row + start // PAGE_SIZE).to(tl.int64)
    elif MASKED:
        return tl.load(block_table_row + pos // PAGE_SIZE, mask=key_ok, other=0).to(tl.int64)
    else:
        return tl.load(block_table_row + pos // PAGE_SIZE).to(tl.int64)


@triton.jit
def load_paged_kv(KCache, VCache, KScale, VScale, block_table_row, start, kv_head, key_end,
                  stride_cache_block, stride_cache_slot, stride_cache_head,
                  stride_scale_block, stride_scale_slot,
                  HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                  PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr, QUANT: tl.constexpr):
    """Gather the cached tokens [start, start + BLOCK_N) of one KV head through
    the request's block table: K transposed to [D, N], V as [N, D], and with
    QUANT their scales [N], [N] (else placeholders).

    `start` is a multiple of BLOCK_N, so when a page holds at least one tile the
    tile lies in one page and one scalar block-table read serves it. Positions
    >= key_end (only checked when MASKED) read as 0, so stale cache contents,
    NaN included, never reach the dot products.
    """
    pos = start + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    key_ok = pos < key_end
    page = tile_pages(block_table_row, start, pos, key_ok, BLOCK_N, PAGE_SIZE, MASKED)
    offs = page * stride_cache_block + (pos % PAGE_SIZE) * stride_cache_slot + kv_head * stride_cache_head
    if MASKED or HEAD_DIM_PAD != HEAD_DIM:
        d_ok = offs_d < HEAD_DIM
        k = tl.load(KCache + offs[None, :] + offs_d[:, None],
                    mask=key_ok[None, :] & d_ok[:, None], other=0.0)
        v = tl.load(VCache + offs[:, None] + offs_d[None, :],
                    mask=key_ok[:, None] & d_ok[None, :], other=0.0)
    else:
        k = tl.load(KCache + offs[None, :] + offs_d[:, None])
        v = tl.load(VCache + offs[:, None] + offs_d[None, :])
    k_scale = 1.0  # (unread without QUANT)
    v_scale = 1.0
    if QUANT:
        s_offs = page * stride_scale_block + (pos % PAGE_SIZE) * stride_scale_slot + kv_head
        if MASKED:
            k_scale = tl.load(KScale + s_offs, mask=key_ok, other=0.0)
            v_scale = tl.load(VScale + s_offs, mask=key_ok, other=0.0)
        else:
            k_scale = tl.load(KScale + s_offs)
            v_scale = tl.load(VScale + s_offs)
    return k, v, k_scale, v_scale


@triton.jit
def _prefetch_l2(ptrs):
    """Ask L2 for the 128-byte line at each pointer; nothing comes back to registers."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_paged_keys(KCache, VCache, KScale, VScale, block_table_row, start, end, kv_head,
                        stride_cache_block, stride_cache_slot, stride_cache_head,
                        stride_scale_block, stride_scale_slot,
                        HEAD_DIM: tl.constexpr, NUM_KEYS: tl.constexpr, PAGE_SIZE: tl.constexpr,
                        QUANT: tl.constexpr):
    """Read the block table for tokens [start, min(end, start + NUM_KEYS)) and
    prefetch their K/V rows (and scales) of one head into L2. Meant for the
    time a programmatic dependent launch waits on the kernel before it: L2 is
    where writes land, so a line fetched early is never stale there, and the
    block table is written by no kernel on the GPU (only a host copy)."""
    pos = start + tl.arange(0, NUM_KEYS)
    ok = pos < end
    page = tl.load(block_table_row + pos // PAGE_SIZE, mask=ok, other=0).to(tl.int64)
    offs = page * stride_cache_block + (pos % PAGE_SIZE) * stride_cache_slot + kv_head * stride_cache_head
    for i in tl.static_range(0, HEAD_DIM, 1024 // KCache.dtype.element_ty.primitive_bitwidth):
        _prefetch_l2(KCache + offs + i)   # (one 128-byte line each)
        _prefetch_l2(VCache + offs + i)
    if QUANT:
        s_offs = page * stride_scale_block + (pos % PAGE_SIZE) * stride_scale_slot + kv_head
        _prefetch_l2(KScale + s_offs)
        _prefetch_l2(VScale + s_offs)


@triton.jit
def paged_tile_mask(start, key_end, q_pos, window, tree_bits, step_start, BLOCK_N: tl.constexpr,
                    CAUSAL: tl.constexpr, SLIDING: tl.constexpr, TREE: tl.constexpr):
    """[M, N] bool: which of the keys [start, start + BLOCK_N) each query row sees
    (the rules of `attend_paged_keys`)."""
    pos = start + tl.arange(0, BLOCK_N)
    mask = (pos < key_end)[None, :]
    if TREE:
        # Bits, not a loaded [M, N] mask: no pointer tile in registers.
        in_step = pos >= step_start
        shift = tl.where(in_step, pos - step_start, 0).to(tl.int64)
        allowed = ((tree_bits[:, None] >> shift[None, :]) & 1) != 0
        mask = mask & ((~in_step)[None, :] | allowed)
    elif CAUSAL:
        mask = mask & (pos[None, :] <= q_pos[:, None])
    if SLIDING:
        mask = mask & (q_pos[:, None] - pos[None, :] < window)
    return mask


@triton.jit
def attend_paged_keys(acc, m_i, l_i, q, KCache, VCache, KScale, VScale, block_table_row, kv_head,
                      lo, hi, key_end, q_pos, window, qk_scale,
                      stride_cb, stride_cs, stride_ch, stride_sb, stride_ss, tree_bits, step_start,
                      HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                      PAGE_SIZE: tl.constexpr, CAUSAL: tl.constexpr, SLIDING: tl.constexpr,
                      TREE: tl.constexpr, MASKED: tl.constexpr, QUANT: tl.constexpr):
    """Attend the query tile to cached keys [lo, hi) (lo a multiple of BLOCK_N).

    q: [M, D]; q_pos: [M] positions of the query rows. When MASKED, keys must be
    < key_end, and: with TREE, a key at or after `step_start` (the first query
    token's position) is seen only where the row's tree mask (`tree_bits`: [M] int64
    bitmasks, bit j = the step's token j) allows; else with CAUSAL, pos <= q_pos;
    with SLIDING, q_pos - pos < window. Unmasked ranges skip all of that.
    """
    for start in tl.range(lo, hi, BLOCK_N):
        start = tl.multiple_of(start, BLOCK_N)
        k, v, k_scale, v_scale = load_paged_kv(
            KCache, VCache, KScale, VScale, block_table_row, start, kv_head, key_end,
            stride_cb, stride_cs, stride_ch, stride_sb, stride_ss, HEAD_DIM, HEAD_DIM_PAD,
            BLOCK_N, PAGE_SIZE, MASKED, QUANT)
        qk = exact_dot(q, k.to(q.dtype))
        if QUANT:
            qk = qk * k_scale[None, :]
        if MASKED:
            mask = paged_tile_mask(start, key_end, q_pos, window, tree_bits, step_start, BLOCK_N,
                                   CAUSAL, SLIDING, TREE)
            acc, m_i, l_i = softmax_tile_update(acc, m_i, l_i, qk, v.to(q.dtype), qk_scale, mask, True,
                                                v_scale, QUANT)
        else:  # (q_pos stands in for the unused mask)
            acc, m_i, l_i = softmax_tile_update(acc, m_i, l_i, qk, v.to(q.dtype), qk_scale, q_pos, False,
                                                v_scale, QUANT)
    return acc, m_i, l_i


@triton.jit
def attend_paged_range(acc, m_i, l_i, q, KCache, VCache, KScale, VScale, block_table_row, kv_head,
                       lo, clean_end, hi, key_end, q_pos, window, qk_scale,
                       stride_cb, stride_cs, stride_ch, stride_sb, stride_ss, tree_bits, step_start,
                       HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                       PAGE_SIZE: tl.constexpr, CAUSAL: tl.constexpr, SLIDING: tl.constexpr,
                       TREE: tl.constexpr, QUANT: tl.constexpr):
    """Cached keys [lo, hi): tiles before `clean_end` (every row sees all of
    them) unmasked, the rest masked. lo and clean_end are multiples of BLOCK_N.
    KScale/VScale (read with QUANT): [blocks, page, kv_heads] fp32, head stride 1."""
    acc, m_i, l_i = attend_paged_keys(
        acc, m_i, l_i, q, KCache, VCache, KScale, VScale, block_table_row, kv_head, lo, clean_end,
        key_end, q_pos, window, qk_scale, stride_cb, stride_cs, stride_ch, stride_sb, stride_ss,
        tree_bits, step_start, HEAD_DIM, HEAD_DIM_PAD, BLOCK_N, PAGE_SIZE, CAUSAL, SLIDING, TREE,
        False, QUANT)
    return attend_paged_keys(
        acc, m_i, l_i, q, KCache, VCache, KScale, VScale, block_table_row, kv_head, clean_end, hi,
        key_end, q_pos, window, qk_scale, stride_cb, stride_cs, stride_ch, stride_sb, stride_ss,
        tree_bits, step_start, HEAD_DIM, HEAD_DIM_PAD, BLOCK_N, PAGE_SIZE, CAUSAL, SLIDING, TREE,
        True, QUANT)


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def check_kv_scales(k_cache, v_cache, k_scale, v_scale) -> bool:
    """Whether the cache is quantized; checks the scale pools' layout if so."""
    if k_scale is None and v_scale is None:
        if k_cache.dtype in (torch.int8, torch.float8_e4m3fn):
            raise ValueError(f"a {k_cache.dtype} KV cache needs its k_scale and v_scale")
        return False
    assert k_scale is not None and v_scale is not None
    assert k_scale.dtype == torch.float32 and k_scale.shape == k_cache.shape[:3]
    assert k_scale.stride() == v_scale.stride() and k_scale.stride(2) == 1
    assert k_cache.dtype == v_cache.dtype and k_cache.element_size() == 1
    return True

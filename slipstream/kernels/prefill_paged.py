"""The prefill kernel's loop over cached keys: K/V tiles read through the block table.

A request's cached keys sit in pages of PAGE_SIZE tokens scattered over the
pool; the block table maps a position to its page. How a BLOCK_N-key tile is
fetched is the `load` mode (a constexpr, chosen by the launcher):

  GATHER   the block-table entries of a tile are read in the same iteration as
           the tile: the K/V addresses wait on that read. Triton's software
           pipeliner then spends one stage on the block-table read and the K/V
           copy of the next tile is issued only after the current tile's dots
           (sm_90 compile: one K/V tile in flight, waited on at once).
  PREFETCH the entries of tile i + 1 are read during tile i and carried in
           registers, so every K/V address is known one iteration ahead and the
           pipeliner keeps a K/V tile in flight behind the current one's math.
  TMA      pages of at least BLOCK_N tokens (one tile in one page): a 2-D tensor
           descriptor over the pool [blocks * page, kv_heads * head_dim] and one
           bulk tensor copy per tile, as for the step's own keys.

Offsets are int32 with OFFS32 (the launcher sets it when the pool holds fewer
than 2**31 elements), else int64. Positions >= key_end read as 0 (or, through
TMA, are zeroed), so stale cache contents, NaN included, never reach a dot.
"""
from __future__ import annotations

import triton
import triton.language as tl

from slipstream.kernels.attention_tile import exact_dot, softmax_tile_update

GATHER, PREFETCH, TMA = 0, 1, 2


@triton.jit
def tile_pages(bt_row, start, key_end, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """Block-table entries of the tile [start, start + BLOCK_N): a scalar when a
    page holds the whole tile, else one entry per key. Entries at or past
    key_end (never read from the table) are 0, a valid block."""
    if PAGE_SIZE >= BLOCK_N:
        return tl.load(bt_row + start // PAGE_SIZE, mask=start < key_end, other=0)
    else:
        pos = start + tl.arange(0, BLOCK_N)
        return tl.load(bt_row + pos // PAGE_SIZE, mask=pos < key_end, other=0)


@triton.jit
def _mask(pos, key_ok, q_pos, window, CAUSAL: tl.constexpr, SLIDING: tl.constexpr):
    """[M, N]: which keys each query row may see."""
    mask = key_ok[None, :]
    if CAUSAL:
        mask = mask & (pos[None, :] <= q_pos[:, None])
    if SLIDING:
        mask = mask & (q_pos[:, None] - pos[None, :] < window)
    return mask


@triton.jit
def _masked_update(acc, m_i, l_i, qk, v, qk_scale, pos, key_ok, q_pos, window, v_scale,
                   CAUSAL: tl.constexpr, SLIDING: tl.constexpr, QUANT: tl.constexpr):
    mask = _mask(pos, key_ok, q_pos, window, CAUSAL, SLIDING)
    return softmax_tile_update(acc, m_i, l_i, qk, v, qk_scale, mask, True, v_scale, QUANT)


@triton.jit
def attend_cached(acc, m_i, l_i, q, KCache, VCache, KScale, VScale, KDesc, VDesc, bt_row,
                  first_pages, kv_head, lo, edge, hi, key_end, q_pos, window, qk_scale,
                  stride_cb, stride_cs, stride_ch, stride_sb, stride_ss,
                  HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                  PAGE_SIZE: tl.constexpr, CAUSAL: tl.constexpr, SLIDING: tl.constexpr,
                  MASKED: tl.constexpr, QUANT: tl.constexpr, LOAD: tl.constexpr,
                  OFFS32: tl.constexpr, ONE_LOOP: tl.constexpr = False,
                  LEAN: tl.constexpr = False):
    """Attend the query tile q [M, D] (rows at positions q_pos [M]) to cached
    keys [lo, hi), lo a multiple of BLOCK_N. MASKED: keys >= key_end, after the
    row (CAUSAL) or out of its window (SLIDING) are masked; else none is.
    ONE_LOOP (with MASKED): one pipeline over all of [lo, hi), the mask applied
    only from `edge` on (a branch a tile), so the edge tiles need no pipeline
    fill of their own; else `edge` is unused.
    LEAN: the per-row parts of the gather addresses (slot, head, the row's page
    within the tile) computed once before the loop, and, in an unmasked loop,
    the next tile's block-table entries read unmasked (the tile index clamped
    to the loop's last tile instead), so each tile adds only page * stride.
    first_pages: tile_pages(bt_row, lo, ...), read by the caller as early as it
    can (the masked loop's entries before the unmasked loop runs)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    page_next = first_pages
    # (start is a multiple of BLOCK_N: a row's slot and page within the tile are fixed.)
    row_page = offs_n // PAGE_SIZE
    if PAGE_SIZE < BLOCK_N:
        row_inv = (offs_n % PAGE_SIZE) * stride_cs + kv_head * stride_ch
    else:
        row_inv = offs_n * stride_cs + kv_head * stride_ch
    for start in tl.range(lo, hi, BLOCK_N):
        start = tl.multiple_of(start, BLOCK_N)
        pos = start + offs_n
        key_ok = pos < key_end
        if LOAD == 1 or LOAD == 2:  # PREFETCH (and TMA)
            page = page_next
            if LEAN and not MASKED:  # every tile up to hi is whole and < key_end
                nxt = tl.minimum(start + BLOCK_N, hi - BLOCK_N)
                if PAGE_SIZE >= BLOCK_N:
                    page_next = tl.load(bt_row + nxt // PAGE_SIZE)
                else:
                    page_next = tl.load(bt_row + nxt // PAGE_SIZE + row_page)
            else:
                page_next = tile_pages(bt_row, start + BLOCK_N, key_end, BLOCK_N, PAGE_SIZE)
        else:
            page = tile_pages(bt_row, start, key_end, BLOCK_N, PAGE_SIZE)
        if LOAD == 2 and PAGE_SIZE >= BLOCK_N:  # TMA: the tile is rows [row, row + BLOCK_N) of the 2-D pool
            row = page * PAGE_SIZE + start % PAGE_SIZE
            k = KDesc.load([row, kv_head * HEAD_DIM]).T
            v = VDesc.load([row, kv_head * HEAD_DIM])
            if MASKED:  # slots past the sequence end hold anything, NaN included
                k = tl.where(key_ok[None, :], k, 0.0)
                v = tl.where(key_ok[:, None], v, 0.0)
        else:
            if not OFFS32:
                page = page.to(tl.int64)
            if LEAN and PAGE_SIZE < BLOCK_N:
                offs = page * stride_cb + row_inv
            elif LEAN:
                offs = page * stride_cb + (start % PAGE_SIZE) * stride_cs + row_inv
            else:
                offs = page * stride_cb + (pos % PAGE_SIZE) * stride_cs + kv_head * stride_ch
            # K is read as [N, D] rows like V (one address vector for both) and
            # transposed as the dot reads it from shared memory.
            kv_offs = offs[:, None] + offs_d[None, :]
            if MASKED or HEAD_DIM_PAD != HEAD_DIM:
                kv_ok = key_ok[:, None] & d_ok[None, :]
                k = tl.load(KCache + kv_offs, mask=kv_ok, other=0.0).T
                v = tl.load(VCache + kv_offs, mask=kv_ok, other=0.0)
            else:
                k = tl.load(KCache + kv_offs).T
                v = tl.load(VCache + kv_offs)
        k_scale = 1.0  # (unread without QUANT)
        v_scale = 1.0
        if QUANT:
            s_offs = page * stride_sb + (pos % PAGE_SIZE) * stride_ss + kv_head
            k_scale = tl.load(KScale + s_offs, mask=key_ok, other=0.0)
            v_scale = tl.load(VScale + s_offs, mask=key_ok, other=0.0)
        qk = exact_dot(q, k.to(q.dtype))
        if QUANT:
            qk = qk * k_scale[None, :]
        if ONE_LOOP:
            # Only the scores go under the branch (a dot inside one breaks the pipeliner).
            if start >= edge:
                qk = tl.where(_mask(pos, key_ok, q_pos, window, CAUSAL, SLIDING), qk, -1.0e6)
            acc, m_i, l_i = softmax_tile_update(acc, m_i, l_i, qk, v.to(q.dtype), qk_scale, q_pos,
                                                False, v_scale, QUANT)
        elif MASKED:
            acc, m_i, l_i = _masked_update(acc, m_i, l_i, qk, v.to(q.dtype), qk_scale, pos, key_ok,
                                           q_pos, window, v_scale, CAUSAL, SLIDING, QUANT)
        else:  # (q_pos stands in for the unused mask)
            acc, m_i, l_i = softmax_tile_update(acc, m_i, l_i, qk, v.to(q.dtype), qk_scale, q_pos,
                                                False, v_scale, QUANT)
    return acc, m_i, l_i


def tma_pool_ok(cache) -> bool:
    """Whether TMA tiles can read this pool: [blocks, page, kv_heads, head_dim]
    contiguous, so a 2-D view [blocks * page, kv_heads * head_dim] covers it
    (tiles must also lie in one page: PAGE_SIZE >= BLOCK_N, a kernel check)."""
    return cache.is_contiguous()


def offsets_fit_int32(cache) -> bool:
    return cache.numel() < 2 ** 31

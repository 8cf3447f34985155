"""The order in which the Gluon prefill kernels' programs take their work items
(a query block of one head of one request), shared by their producer and
consumer partitions, which must agree on it.

Items are numbered t = 0 .. total - 1 and mapped to (block, head, request):
  * HEAD_GROUP = 0: the block fastest (longest causal block first), then the head,
    then the request: neighbours share a head's K/V in L2;
  * HEAD_GROUP = G: heads (of one request, then the next) taken G at a time, and within
    such a group the longest blocks of all G heads first, then the next longest..:
    the programs running at once share G heads' K/V (G x 2 MB at 4k tokens: in L2),
    and the short blocks come last, where they even out the programs' ends.
With HEAD_GROUP = ALL_HEADS the order is longest-first over all items (LPT). The grid (not
persistent) dispatches t in order, so there a free SM takes the next longest block. Persistent programs take
t = p, p + P, .. (P programs), or with SNAKE the boustrophedon order over rounds
(round r: r * P + p when r is even, r * P + P - 1 - p when odd), so that with the
longest items first no program gets the longest of every round.
"""
from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

ALL_HEADS = 4096  # HEAD_GROUP for "every head of every request in one group": LPT over all items


@gluon.jit
def work_range(n_mblocks, heads, num_seqs, Items, PERSISTENT: gl.constexpr, SNAKE: gl.constexpr,
               TABLE: gl.constexpr):
    """(i0, i_end, i_step, total): this program's loop over item slots i, and the item count."""
    total = n_mblocks * heads * num_seqs
    if TABLE:  # the host's list of the non-empty items (item_table), its length first
        total = gl.load(Items)
    if PERSISTENT:
        i0, i_end, i_step = gl.program_id(0), total, gl.num_programs(0)
        if SNAKE:  # every program runs every round; slots past the end are empty
            i_end = gl.cdiv(total, i_step) * i_step
    else:  # grid (query block, head, request): one item
        i0 = gl.program_id(0) + n_mblocks * (gl.program_id(1) + heads * gl.program_id(2))
        i_end, i_step = i0 + 1, 1
    return i0, i_end, i_step, total


@gluon.jit
def work_item(i, total, CuSeqlens, Items, n_mblocks, heads, num_seqs, group, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr,
              PERSISTENT: gl.constexpr, SNAKE: gl.constexpr, HEAD_GROUP: gl.constexpr,
              TABLE: gl.constexpr):
    """Item slot i -> (q_start, q_len, m_row0, head, kv_col, n_tiles, mask_from, request);
    n_tiles is 0 for an empty slot or a block past its request's end."""
    q_start, q_len, m_row0, head, kv_col, n_tiles, mask_from, seq, ctx = work_item_kv(
        i, total, CuSeqlens, CuSeqlens, Items, n_mblocks, heads, num_seqs, group, BLOCK_M,
        BLOCK_N, HEAD_DIM, CAUSAL, PERSISTENT, SNAKE, HEAD_GROUP, TABLE, False)
    return q_start, q_len, m_row0, head, kv_col, n_tiles, mask_from, seq


@gluon.jit
def work_item_kv(i, total, CuSeqlens, KvLens, Items, n_mblocks, heads, num_seqs, group,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                 CAUSAL: gl.constexpr, PERSISTENT: gl.constexpr, SNAKE: gl.constexpr,
                 HEAD_GROUP: gl.constexpr, TABLE: gl.constexpr, PAGED: gl.constexpr):
    """work_item, plus the request's cached context `ctx`: with PAGED its keys are
    KvLens[request] (context then the query's own), the query rows the last q_len
    positions; n_tiles and mask_from count key tiles of those keys."""
    t = i
    if PERSISTENT and SNAKE:
        P = gl.num_programs(0)
        r = i // P
        p = i - r * P
        t = r * P + p + (r % 2) * (P - 1 - 2 * p)
    valid = (t < total).to(gl.int32)
    t = gl.minimum(t, total - 1)
    if TABLE:
        seq = gl.load(Items + 1 + 3 * t)
        head = gl.load(Items + 2 + 3 * t)
        mb = n_mblocks - 1 - gl.load(Items + 3 + 3 * t)
    elif HEAD_GROUP > 0:
        span = HEAD_GROUP * n_mblocks
        grp = t // span
        within = t - grp * span
        size = gl.minimum(heads * num_seqs - grp * HEAD_GROUP, HEAD_GROUP)
        mb = within // size
        pair = grp * HEAD_GROUP + within - mb * size
        head = pair % heads
        seq = pair // heads
    else:
        mb = t % n_mblocks
        head = (t // n_mblocks) % heads
        seq = t // (n_mblocks * heads)
    m_row0 = (n_mblocks - 1 - mb) * BLOCK_M
    q_start = gl.load(CuSeqlens + seq)
    q_len = gl.load(CuSeqlens + seq + 1) - q_start
    ctx = 0
    if PAGED:
        ctx = gl.load(KvLens + seq) - q_len
    kv_len = ctx + q_len
    hi = kv_len
    mask_from = kv_len // BLOCK_N * BLOCK_N
    if CAUSAL:
        hi = gl.minimum(kv_len, ctx + m_row0 + BLOCK_M)
        mask_from = gl.minimum((ctx + m_row0) // BLOCK_N * BLOCK_N, mask_from)
    n_tiles = gl.cdiv(hi, BLOCK_N) * (m_row0 < q_len).to(gl.int32) * valid
    return q_start, q_len, m_row0, head, (head // group) * HEAD_DIM, n_tiles, mask_from, seq, ctx


def plan(cfg: dict, lengths, max_seqlen: int, heads: int, cu_seqlens: torch.Tensor, causal: bool,
         sms: int) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """(the kernel's Items argument, grid) of a launch with config cfg (PERSISTENT, TABLE,
    BLOCK_M, BLOCK_N); lengths: the requests' lengths as host ints (needed for TABLE)."""
    num_seqs = cu_seqlens.numel() - 1
    if cfg["TABLE"]:
        if lengths is None or len(lengths) != num_seqs or max(lengths, default=0) > max_seqlen:
            raise ValueError(f"TABLE needs the {num_seqs} request lengths as host ints, at most max_seqlen")
        items = item_table(lengths, heads, cfg["BLOCK_M"], cfg["BLOCK_N"], causal, cu_seqlens.device)
        n = (items.numel() - 1) // 3
        return items, ((min(sms, n) if cfg["PERSISTENT"] else n), 1, 1)
    grid = (-(-max_seqlen // cfg["BLOCK_M"]), heads, num_seqs)
    if cfg["PERSISTENT"]:
        grid = (min(sms, grid[0] * grid[1] * grid[2]), 1, 1)
    return cu_seqlens, grid


def item_table(lengths: tuple[int, ...], heads: int, block_m: int, block_n: int, causal: bool,
               device) -> torch.Tensor:
    """int32 [1 + 3 n]: n, then (request, head, query block) of every non-empty item,
    the most key tiles first (ties: by block, request, head). Cached per arguments."""
    return _item_table(tuple(lengths), heads, block_m, block_n, causal, str(device))


@functools.lru_cache(maxsize=64)
def _item_table(lengths, heads, block_m, block_n, causal, device) -> torch.Tensor:
    items = []
    for seq, n in enumerate(lengths):
        for mb in range(-(-n // block_m)):
            tiles = -(-min(n, (mb + 1) * block_m) // block_n) if causal else -(-n // block_n)
            items += [(-tiles, -mb, seq, head) for head in range(heads)]
    items.sort()
    flat = [len(items)] + [x for _, mb, seq, head in items for x in (seq, head, -mb)]
    return torch.tensor(flat, dtype=torch.int32).to(device)


def schedule(n_mblocks: int, heads: int, num_seqs: int, programs: int | None, snake: bool = False,
             head_group: int = 0) -> list[list[tuple[int, int, int]]]:
    """Plain-Python twin of work_range / work_item: per program, its items in order as
    (query block index, head, request). programs None: the grid (one item each)."""
    total = n_mblocks * heads * num_seqs
    persistent = programs is not None
    p_count = programs if persistent else total
    out = []
    for p in range(p_count):
        slots = range(p, -(-total // p_count) * p_count if snake else total, p_count) if persistent else [p]
        items = []
        for i in slots:
            t = i
            if persistent and snake:
                r, q = divmod(i, p_count)
                t = r * p_count + (q if r % 2 == 0 else p_count - 1 - q)
            if t >= total:
                continue
            if head_group > 0:
                grp, within = divmod(t, head_group * n_mblocks)
                size = min(heads * num_seqs - grp * head_group, head_group)
                mb, pair = within // size, grp * head_group + within % size
                head, seq = pair % heads, pair // heads
            else:
                mb, head, seq = t % n_mblocks, (t // n_mblocks) % heads, t // (n_mblocks * heads)
            items.append((n_mblocks - 1 - mb, head, seq))
        out.append(items)
    return out

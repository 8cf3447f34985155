"""Device code of the Gluon (sm_90) attention kernels at the level of one query
block: its TMA copies, its online softmax, and its loop of asynchronous wgmma
over the K/V ring (FlashAttention-3's intra-warpgroup pipelining).

K/V tiles are numbered across every block a program (or a persistent one) has
done, `it`: tile `it` sits in ring slot it % STAGES, and its ready / empty
barriers complete for the (it // STAGES)-th time when it lands / is released.
`kv_empty` holds K's empty barriers (slot) then V's (STAGES + slot): K is
released as soon as its scores are done, a softmax before V, so that with two
stages the next-but-one K tile is not requested just as it is needed (measured
on the H200: one shared release made 2 stages 25% slower than 3).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)


@gluon.jit
def copy_tile(desc, buf, bar, row, kv_col, table, tile, n_pages, pred, PAGED: gl.constexpr,
              PAGE: gl.constexpr, BLOCK_N: gl.constexpr):
    """TMA copies of key tile `tile` (BLOCK_N keys of one KV head) into `buf`: rows
    row.. of a packed K or V, or with PAGED one copy a PAGE-token page (one copy of
    a page's part when pages are at least a tile), its block read from the
    request's block-table row `table` (pages past the request's n_pages read
    block 0; their keys are masked)."""
    if PAGED and PAGE >= BLOCK_N:   # the tile inside one page
        page = tile * BLOCK_N // PAGE
        block = gl.load(table + page, mask=page < n_pages, other=0)
        tma.async_copy_global_to_shared(desc, [block * PAGE + tile * BLOCK_N % PAGE, kv_col], bar,
                                        buf, pred)
    elif PAGED:
        for i in gl.static_range(BLOCK_N // PAGE):
            page = tile * (BLOCK_N // PAGE) + i
            block = gl.load(table + page, mask=page < n_pages, other=0)
            tma.async_copy_global_to_shared(desc, [block * PAGE, kv_col], bar,
                                            buf.slice(i * PAGE, PAGE), pred)
    else:
        tma.async_copy_global_to_shared(desc, [row, kv_col], bar, buf, pred)


@gluon.constexpr_function
def tile_bytes(copy_bytes, PAGED, PAGE, BLOCK_N):
    """Bytes one key tile's copies land (what its ready barrier expects)."""
    return copy_bytes * (BLOCK_N // PAGE if PAGED and PAGE < BLOCK_N else 1)


@gluon.jit
def load_kv(k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, it, row, kv_col, pred, table, tile,
            n_pages, STAGES: gl.constexpr, PAGED: gl.constexpr, PAGE: gl.constexpr,
            BLOCK_N: gl.constexpr):
    """Start the TMA copies of K/V tile `it` (key tile `tile` of the request: rows
    row.. of packed K/V, or pages of the cache, columns of one KV head)."""
    slot = it % STAGES
    mbarrier.expect(k_ready.index(slot), tile_bytes(k_desc.block_type.nbytes, PAGED, PAGE, BLOCK_N), pred)
    copy_tile(k_desc, k_bufs.index(slot), k_ready.index(slot), row, kv_col, table, tile, n_pages,
              pred, PAGED, PAGE, BLOCK_N)
    mbarrier.expect(v_ready.index(slot), tile_bytes(v_desc.block_type.nbytes, PAGED, PAGE, BLOCK_N), pred)
    copy_tile(v_desc, v_bufs.index(slot), v_ready.index(slot), row, kv_col, table, tile, n_pages,
              pred, PAGED, PAGE, BLOCK_N)


@gluon.jit
def produce_block(k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, kv_empty, q_start, kv_col,
                  j0, j1, it0, table, n_pages, STAGES: gl.constexpr, BLOCK_N: gl.constexpr,
                  PAGED: gl.constexpr, PAGE: gl.constexpr):
    """The producer warp's part of one block, tiles j0..j1-1: each K, then V, tile
    as soon as its slot is free."""
    for j in range(j0, j1):
        it = it0 + j
        slot = it % STAGES
        row = q_start + j * BLOCK_N
        phase = ((it - STAGES) // STAGES) & 1
        if it >= STAGES:
            mbarrier.wait(kv_empty.index(slot), phase)
        mbarrier.expect(k_ready.index(slot), tile_bytes(k_desc.block_type.nbytes, PAGED, PAGE, BLOCK_N))
        copy_tile(k_desc, k_bufs.index(slot), k_ready.index(slot), row, kv_col, table, j, n_pages,
                  True, PAGED, PAGE, BLOCK_N)
        if it >= STAGES:
            mbarrier.wait(kv_empty.index(STAGES + slot), phase)
        mbarrier.expect(v_ready.index(slot), tile_bytes(v_desc.block_type.nbytes, PAGED, PAGE, BLOCK_N))
        copy_tile(v_desc, v_bufs.index(slot), v_ready.index(slot), row, kv_col, table, j, n_pages,
                  True, PAGED, PAGE, BLOCK_N)


@gluon.jit
def _fold(x, IS_MAX: gl.constexpr):
    """[R, N] -> [R, N // 2]: columns c and c + N // 2 combined (a register bit of the
    wgmma layout, so no value moves between threads)."""
    a, b = gl.split(gl.permute(gl.reshape(x, [x.shape[0], 2, x.shape[1] // 2]), (0, 2, 1)))
    if IS_MAX:
        return gl.maximum(a, b)
    else:
        return a + b


@gluon.jit
def row_reduce(x, IS_MAX: gl.constexpr, TREE: gl.constexpr):
    """Row max (IS_MAX) or sum of a [R, N] wgmma tile, in x's row layout. TREE: halve
    the columns pairwise down to 8 (four levels at N = 128) before the reduction, so a
    thread's chain is ~5 operations deep, not one after another over its 32 values of
    a row (what gl.max / gl.sum compile to)."""
    row: gl.constexpr = gl.SliceLayout(1, x.type.layout)
    if TREE:
        y = x
        if y.shape[1] > 64:
            y = _fold(y, IS_MAX)
        if y.shape[1] > 32:
            y = _fold(y, IS_MAX)
        if y.shape[1] > 16:
            y = _fold(y, IS_MAX)
        if y.shape[1] > 8:
            y = _fold(y, IS_MAX)
        if IS_MAX:
            return gl.convert_layout(gl.max(y, axis=1), row)
        else:
            return gl.convert_layout(gl.sum(y, axis=1), row)
    else:
        if IS_MAX:
            return gl.max(x, axis=1)
        else:
            return gl.sum(x, axis=1)


@gluon.jit
def softmax_tile(s, m_i, l_i, start, offs_m, kv_len, mask_from, qk_scale,
                 CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, s_layout: gl.constexpr,
                 TREE: gl.constexpr):
    """Online softmax of one score tile (keys start..start+BLOCK_N; rows at positions
    offs_m). m_i is kept in log2 units (scaled), so p = exp2(s * scale - m) is one
    FMA and one MUFU op. Only tiles at or past mask_from (causal diagonal, the
    request's last keys) are masked."""
    if start >= mask_from:
        offs_n = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        keep = offs_n[None, :] < kv_len
        if CAUSAL:
            keep = keep & (offs_n[None, :] <= offs_m[:, None])
        s = gl.where(keep, s, float("-inf"))
    # Every row sees key 0 in the first tile, so m_new is finite from there on.
    m_new = gl.maximum(m_i, row_reduce(s, True, TREE) * qk_scale)
    p = gl.exp2(s * qk_scale - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + row_reduce(p, False, TREE)
    return p, m_new, l_i, alpha


@gluon.jit
def retire_pv(acc_tok, p_op, always):
    """Wait for P.V (deps keep P's registers alive until then). ptxas hoists a
    wgmma wait to the top of its basic block, here above the whole softmax (seen
    in the SASS); behind a branch on a value it cannot know (`always`, true) the
    wait stays below it. The other branch differs at both ends so that LLVM
    neither hoists nor sinks the wait out of the branches."""
    if always:
        acc, p_op = warpgroup_mma_wait(0, deps=(acc_tok, p_op))
    else:
        gl.thread_barrier()
        acc, p_op = warpgroup_mma_wait(0, deps=(acc_tok, p_op))
        gl.thread_barrier()
    return acc


@gluon.jit
def attend_block(q_smem, q_ready, q_phase, k_bufs, v_bufs, k_ready, v_ready, kv_empty, turn_bars,
                 k_desc, v_desc, o_desc, Out, q_start, q_len, m_row0, head, kv_col, n_tiles, it0,
                 mask_from, stride_ot, qk_scale, ctx, table, n_pages, ME: gl.constexpr,
                 CAUSAL: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
                 HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, WARPS: gl.constexpr,
                 SELF_LOAD: gl.constexpr, TURNS: gl.constexpr, PIN: gl.constexpr,
                 PAGED: gl.constexpr, PAGE: gl.constexpr, TREE: gl.constexpr,
                 LATE_K: gl.constexpr):
    """ROWS query rows (m_row0.. of the request) against its key tiles it0.. (n_tiles),
    then the output stored. The request's keys are its ctx cached ones, then its
    q_len own (ctx 0 without paging); query row r sits at position ctx + r.
    SELF_LOAD: these warps also issue the copies (it0 = 0).
    TURNS (ping-pong): warpgroup ME takes turns (turn_bars) with its partner to issue its
    GEMMs; both take one turn a tile, so turn k is tile it0 + j. PIN: keep the P.V
    wait below the softmax (retire_pv); off only to measure it. TREE: the softmax's row
    reductions by pairwise halving (row_reduce). LATE_K: release K_j once P_{j-1} V_{j-1}
    has retired, beside V_{j-1}: each mbarrier arrive syncs the warpgroup (bar.sync) before
    one thread arrives, and two side by side cost about one sync."""
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout([3, 0], [WARPS, 1], [16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout([3, 0], [WARPS, 1], [16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(0, o_layout, 2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_row: gl.constexpr = gl.SliceLayout(1, o_layout)
    offs_m = ctx + m_row0 + gl.arange(0, ROWS, layout=row_layout)   # the rows' positions
    kv_len = ctx + q_len
    zero_s = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)

    # Tile 0: its scores alone, so the loop below always has a P to multiply.
    mbarrier.wait(q_ready, q_phase)
    mbarrier.wait(k_ready.index(it0 % STAGES), (it0 // STAGES) & 1)
    if TURNS:
        mbarrier.wait(turn_bars.index(ME), it0 & 1)
    s_tok = warpgroup_mma(q_smem, k_bufs.index(it0 % STAGES).permute((1, 0)), zero_s,
                          use_acc=False, is_async=True)
    if TURNS:
        mbarrier.arrive(turn_bars.index(1 - ME))
    s = warpgroup_mma_wait(0, deps=(s_tok,))
    if not SELF_LOAD:
        mbarrier.arrive(kv_empty.index(it0 % STAGES))  # K_0 is consumed
    m_i = gl.full([ROWS], float("-inf"), gl.float32, row_layout)
    l_i = gl.zeros([ROWS], gl.float32, row_layout)
    p, m_i, l_i, alpha = softmax_tile(s, m_i, l_i, 0, offs_m, kv_len, mask_from, qk_scale,
                                      CAUSAL, BLOCK_N, s_layout, TREE)
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)

    for j in range(1, n_tiles):
        it = it0 + j
        slot = it % STAGES
        prev = (it - 1) % STAGES
        mbarrier.wait(k_ready.index(slot), (it // STAGES) & 1)
        mbarrier.wait(v_ready.index(prev), ((it - 1) // STAGES) & 1)
        if TURNS:
            mbarrier.wait(turn_bars.index(ME), it & 1)
        # Issue S_j = Q K_j^T, rescale O (idle now), issue O += P_{j-1} V_{j-1};
        # the softmax of S_j below runs while P.V is still on the tensor cores.
        s_tok = warpgroup_mma(q_smem, k_bufs.index(slot).permute((1, 0)), zero_s,
                              use_acc=False, is_async=True)
        acc = acc * gl.convert_layout(alpha, o_row)[:, None]
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        acc_tok = warpgroup_mma(p_op, v_bufs.index(prev), acc, is_async=True)
        if TURNS:
            mbarrier.arrive(turn_bars.index(1 - ME))
        s = warpgroup_mma_wait(1, deps=(s_tok,))  # wgmma groups retire in order: S_j done
        if not SELF_LOAD and not LATE_K:
            mbarrier.arrive(kv_empty.index(slot))  # K_j is consumed
        p, m_i, l_i, alpha = softmax_tile(s, m_i, l_i, j * BLOCK_N, offs_m, kv_len, mask_from,
                                          qk_scale, CAUSAL, BLOCK_N, s_layout, TREE)
        if PIN:
            acc = retire_pv(acc_tok, p_op, q_start >= 0)
        else:
            acc, p_op = warpgroup_mma_wait(0, deps=(acc_tok, p_op))
        # V_{j-1} is consumed (the P.V just retired), and with it all of tile j - 1.
        if SELF_LOAD:
            gl.thread_barrier()  # both warpgroups are past it before it is overwritten
            load_kv(k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, j - 1 + STAGES,
                    q_start + (j - 1 + STAGES) * BLOCK_N, kv_col, j - 1 + STAGES < n_tiles, table,
                    j - 1 + STAGES, n_pages, STAGES, PAGED, PAGE, BLOCK_N)
        else:
            if LATE_K:  # K_j released beside V_{j-1}: one sync point a tile where there were two
                mbarrier.arrive(kv_empty.index(slot))
            mbarrier.arrive(kv_empty.index(STAGES + prev))

    last = it0 + n_tiles - 1
    mbarrier.wait(v_ready.index(last % STAGES), (last // STAGES) & 1)
    acc = acc * gl.convert_layout(alpha, o_row)[:, None]
    p_op = gl.convert_layout(p.to(dtype), p_layout)
    acc_tok = warpgroup_mma(p_op, v_bufs.index(last % STAGES), acc, is_async=True)
    acc, p_op = warpgroup_mma_wait(0, deps=(acc_tok, p_op))
    if not SELF_LOAD:
        mbarrier.arrive(kv_empty.index(STAGES + last % STAGES))

    out = (acc / gl.convert_layout(l_i, o_row)[:, None]).to(dtype)
    if m_row0 + ROWS <= q_len:  # a full block: through shared memory (Q's, now free), one bulk store
        q_smem.store(out)
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [q_start + m_row0, head * HEAD_DIM], q_smem)
        tma.store_wait(0)
    else:  # the request's last rows: a masked store, the next request's rows untouched
        rows = m_row0 + gl.arange(0, ROWS, layout=o_row)
        cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        ptrs = Out + (q_start + rows).to(gl.int64)[:, None] * stride_ot + head * HEAD_DIM + cols[None, :]
        gl.store(ptrs, out, mask=(rows < q_len)[:, None])

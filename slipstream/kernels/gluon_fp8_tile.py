"""Device code of the FP8 (e4m3) Gluon prefill kernel at the level of one query
block: both GEMMs on the FP8 tensor cores, the block scales folded in for free.

Operands (gluon_fp8_prefill.py): Q and K in e4m3 with one scale per block of
tokens (Q: per row, any block; K: per BLOCK_N tile), V transposed (V^T, tokens
contiguous: FP8 wgmma takes its shared-memory B operand K-major only) with one
scale per BLOCK_N tile. How the scales cost nothing:
  * scores: s_true = s * q_scale[row] * k_scale[tile], so the softmax's
    exp2(s * qk_scale - m) becomes exp2(s * f[row] - m), still one FMA;
  * P is cast to e4m3 in registers as P * 2^P_SHIFT (2^8 = 256 <= 448, so the
    small probabilities of a long row keep 2^-17 of resolution, not 2^-9) by
    shifting the exp2's bias; the row sum l is taken of the same values, so
    the factor cancels in O / l;
  * V's tile scale: O is kept in units of the last tile's V scale; the
    per-row rescale alpha that O gets every step anyway is multiplied by
    v_scale[previous] / v_scale[this] (a scalar), and the output by the last.
The loop is the bf16 kernel's (gluon_attention_tile.attend_block): S_j issued
before P_{j-1} V_{j-1}, the softmax of S_j under P.V, ping-pong turns.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

from .gluon_attention_tile import row_reduce


P_SHIFT = 8.0  # log2 of the factor P is stored with in e4m3 (256 <= 448)


@gluon.jit
def retire_pv_fp8(acc_tok, always):
    """gluon_attention_tile.retire_pv without P among the deps: Triton 3.6 cannot
    keep 8-bit registers alive through a wgmma wait ("Unexpected bitwidth in
    WGMMAWaitGroupOp: 8"); ptxas keeps P's registers from reuse while the
    wgmma reads them (the compile check reads its C7515 serialisation notes)."""
    if always:
        acc = warpgroup_mma_wait(0, deps=(acc_tok,))
    else:
        gl.thread_barrier()
        acc = warpgroup_mma_wait(0, deps=(acc_tok,))
        gl.thread_barrier()
    return acc


@gluon.jit
def p_operand(p, p_layout: gl.constexpr, KEY_PERM: gl.constexpr):
    """P (the scores' wgmma layout, fp32 or e4m3) as P.V's register A operand. KEY_PERM
    (e4m3): the tile's keys taken in the order the A operand's registers already hold
    them, so no value moves between threads: A column a = a0 + 2 a1 + 4 a2 + 8 a3 + 16 a4..
    is key a0 + 8 a1 + 2 a2 + 4 a3 + 16 a4.. (the key bits 1-2 are the lane's in both
    layouts, bit 0 and bits 3.. a register's); V^T's tokens are stored in the same order
    within each 16 (gluon_fp8_inputs.KEY_PERM_16). Otherwise the A operand's layout
    (16 SHFL.IDX and 16 SEL a tile in the SASS)."""
    if KEY_PERM:
        R: gl.constexpr = p.shape[0]
        N: gl.constexpr = p.shape[1]
        x = p.reshape([R, N // 16, 2, 2, 2, 2])        # key: sixteens, bits c3 c2 c1 c0
        x = gl.permute(x, (0, 1, 3, 4, 2, 5))          # -> a3=c2 a2=c1 a1=c3 a0=c0
        return gl.convert_layout(x.reshape([R, N]), p_layout)
    else:
        return gl.convert_layout(p, p_layout)


@gluon.jit
def produce_block_fp8(k_desc, vt_desc, k_bufs, v_bufs, k_ready, v_ready, kv_empty, q_start,
                      v_start, kv_col, j0, j1, it0, STAGES: gl.constexpr, BLOCK_N: gl.constexpr,
                      V_FP8: gl.constexpr):
    """The producer warp's part of one block, tiles j0..j1-1: K tile [BLOCK_N, D] at
    (q_start + j * BLOCK_N, kv_col), V^T tile [D, BLOCK_N] at (kv_col, v_start + j * BLOCK_N)
    (not V_FP8: V [BLOCK_N, D] as K). TMA needs V^T's (inner) token coordinate 16-byte
    aligned (unaligned ones raised "illegal instruction" on the H200): each request's
    columns start at a multiple of 16 (gluon_fp8_inputs)."""
    for j in range(j0, j1):
        it = it0 + j
        slot = it % STAGES
        row = q_start + j * BLOCK_N
        phase = ((it - STAGES) // STAGES) & 1
        if it >= STAGES:
            mbarrier.wait(kv_empty.index(slot), phase)
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [row, kv_col], k_ready.index(slot), k_bufs.index(slot))
        if it >= STAGES:
            mbarrier.wait(kv_empty.index(STAGES + slot), phase)
        mbarrier.expect(v_ready.index(slot), vt_desc.block_type.nbytes)
        if V_FP8:
            tma.async_copy_global_to_shared(vt_desc, [kv_col, v_start + j * BLOCK_N], v_ready.index(slot),
                                            v_bufs.index(slot))
        else:
            tma.async_copy_global_to_shared(vt_desc, [row, kv_col], v_ready.index(slot), v_bufs.index(slot))


@gluon.jit
def _v_operand(v_tile, V_FP8: gl.constexpr):
    """P.V's B operand [BLOCK_N, D]: V^T's tile transposed (tokens contiguous: K-major), or V's."""
    if V_FP8:
        return v_tile.permute((1, 0))
    else:
        return v_tile


@gluon.jit
def softmax_tile_fp8(s, m_i, l_i, f, start, offs_m, q_len, CAUSAL: gl.constexpr,
                     BLOCK_N: gl.constexpr, s_layout: gl.constexpr, MASK: gl.constexpr,
                     TREE: gl.constexpr):
    """Online softmax of one FP8 score tile; f [rows] = q_scale * k_scale * qk_scale
    (> 0), m_i in log2 units. Returns P * 2^P_SHIFT (and l of the same). MASK: the
    tile reaches the causal diagonal or the request's end (a runtime branch here was
    if-converted by the compiler: its compares and selects ran on every tile). TREE: row
    max and sum by pairwise halving (gluon_attention_tile.row_reduce)."""
    if MASK:
        offs_n = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        keep = offs_n[None, :] < q_len
        if CAUSAL:
            keep = keep & (offs_n[None, :] <= offs_m[:, None])
        s = gl.where(keep, s, float("-inf"))
    m_new = gl.maximum(m_i, row_reduce(s, True, TREE) * f)
    p = gl.exp2(s * f[:, None] - (m_new - 8.0)[:, None])  # 8.0 = P_SHIFT
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + row_reduce(p, False, TREE)
    return p, m_new, l_i, alpha


@gluon.jit
def _tiles_fp8(j0, j1, acc, p, m_i, l_i, alpha, vs_prev, qf, offs_m, zero_s, q_smem, k_bufs, v_bufs,
               k_ready, v_ready, kv_empty, turn_bars, kv_base, v_base, tile_step, q_start, q_len,
               it0, ME: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr,
               STAGES: gl.constexpr, PIN: gl.constexpr, V_FP8: gl.constexpr,
               s_layout: gl.constexpr, o_row: gl.constexpr, p_layout: gl.constexpr,
               MASK: gl.constexpr, TURNS: gl.constexpr, KEY_PERM: gl.constexpr,
               TREE: gl.constexpr, LATE_K: gl.constexpr):
    """Key tiles j0..j1-1 of a block: issue S_j, rescale O, issue P_{j-1} V_{j-1}, the
    softmax of S_j under it, retire P.V. Returns the carried state."""
    for j in range(j0, j1):
        it = it0 + j
        slot = it % STAGES
        prev = (it - 1) % STAGES
        ks = gl.load(kv_base + j * tile_step)
        vs = gl.load(v_base + (j - 1) * tile_step)  # P_{j-1} V_{j-1}'s scale
        mbarrier.wait(k_ready.index(slot), (it // STAGES) & 1)
        mbarrier.wait(v_ready.index(prev), ((it - 1) // STAGES) & 1)
        if TURNS:
            mbarrier.wait(turn_bars.index(ME), it & 1)
        s_tok = warpgroup_mma(q_smem, k_bufs.index(slot).permute((1, 0)), zero_s,
                              use_acc=False, is_async=True)
        acc = acc * gl.convert_layout(alpha * (vs_prev / vs), o_row)[:, None]
        vs_prev = vs
        p_op = p_operand(p.to(v_bufs.dtype), p_layout, KEY_PERM)
        acc_tok = warpgroup_mma(p_op, _v_operand(v_bufs.index(prev), V_FP8), acc, is_async=True)
        if TURNS:
            mbarrier.arrive(turn_bars.index(1 - ME))
        s = warpgroup_mma_wait(1, deps=(s_tok,))
        if not LATE_K:
            mbarrier.arrive(kv_empty.index(slot))  # K_j is consumed
        p, m_i, l_i, alpha = softmax_tile_fp8(s, m_i, l_i, qf * ks, j * BLOCK_N, offs_m, q_len,
                                              CAUSAL, BLOCK_N, s_layout, MASK, TREE)
        if PIN:
            acc = retire_pv_fp8(acc_tok, q_start >= 0)
        else:
            acc = warpgroup_mma_wait(0, deps=(acc_tok,))
        if LATE_K:  # K_j released beside V_{j-1}: one sync point a tile where there were two
            mbarrier.arrive(kv_empty.index(slot))
        mbarrier.arrive(kv_empty.index(STAGES + prev))  # V_{j-1} is consumed
    return acc, p, m_i, l_i, alpha, vs_prev


@gluon.jit
def attend_block_fp8(q_smem, q_ready, q_phase, k_bufs, v_bufs, k_ready, v_ready, kv_empty,
                     turn_bars, Out, QScale, KScale, VScale, q_start, q_len, m_row0, head, heads,
                     kv_head, kv_heads, n_tiles, it0, mask_from, stride_ot, qk_scale,
                     ME: gl.constexpr, CAUSAL: gl.constexpr, ROWS: gl.constexpr,
                     BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                     WARPS: gl.constexpr, PIN: gl.constexpr, V_FP8: gl.constexpr,
                     TURNS: gl.constexpr, KEY_PERM: gl.constexpr, TREE: gl.constexpr,
                     LATE_K: gl.constexpr):
    """ROWS query rows (m_row0.. of the request) against key tiles it0.. (n_tiles) with
    ping-pong turns; the output (Out's dtype) stored with a masked store.
    Scales: QScale [tokens, heads], KScale / VScale [tokens, kv_heads] fp32 (a tile's
    scale is read at its first token). Not V_FP8 (QK^T-only FP8): V [BLOCK_N, D] tiles in
    v_bufs' 16-bit dtype, P cast to it, V's scale 1."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout([3, 0], [WARPS, 1], [16, BLOCK_N, 32])
    p_dtype: gl.constexpr = v_bufs.dtype
    o_layout: gl.constexpr = gl.NVMMADistributedLayout([3, 0], [WARPS, 1],
                                                       [16, HEAD_DIM, 256 // p_dtype.primitive_bitwidth])
    p_layout: gl.constexpr = gl.DotOperandLayout(0, o_layout, 32 // p_dtype.primitive_bitwidth)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_row: gl.constexpr = gl.SliceLayout(1, o_layout)
    offs_m = m_row0 + gl.arange(0, ROWS, layout=row_layout)
    zero_s = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    qf = gl.load(QScale + (q_start + offs_m).to(gl.int64) * heads + head, mask=offs_m < q_len,
                 other=1.0) * qk_scale
    kv_base = KScale + q_start.to(gl.int64) * kv_heads + kv_head
    v_base = VScale + q_start.to(gl.int64) * kv_heads + kv_head
    tile_step = BLOCK_N * kv_heads

    mbarrier.wait(q_ready, q_phase)
    mbarrier.wait(k_ready.index(it0 % STAGES), (it0 // STAGES) & 1)
    if TURNS:
        mbarrier.wait(turn_bars.index(ME), it0 & 1)
    s_tok = warpgroup_mma(q_smem, k_bufs.index(it0 % STAGES).permute((1, 0)), zero_s,
                          use_acc=False, is_async=True)
    if TURNS:
        mbarrier.arrive(turn_bars.index(1 - ME))
    ks = gl.load(kv_base)
    vs_prev = gl.load(v_base)  # the V scale O is kept in
    s = warpgroup_mma_wait(0, deps=(s_tok,))
    mbarrier.arrive(kv_empty.index(it0 % STAGES))  # K_0 is consumed
    m_i = gl.full([ROWS], float("-inf"), gl.float32, row_layout)
    l_i = gl.zeros([ROWS], gl.float32, row_layout)
    p, m_i, l_i, alpha = softmax_tile_fp8(s, m_i, l_i, qf * ks, 0, offs_m, q_len, CAUSAL, BLOCK_N,
                                          s_layout, True, TREE)
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)

    # tiles 1 .. n_free - 1 need no mask, the rest (diagonal, request end) do
    n_free = gl.maximum(gl.minimum(mask_from // BLOCK_N, n_tiles), 1)
    acc, p, m_i, l_i, alpha, vs_prev = _tiles_fp8(
        1, n_free, acc, p, m_i, l_i, alpha, vs_prev, qf, offs_m, zero_s, q_smem, k_bufs, v_bufs,
        k_ready, v_ready, kv_empty, turn_bars, kv_base, v_base, tile_step, q_start, q_len, it0, ME,
        CAUSAL, BLOCK_N, STAGES, PIN, V_FP8, s_layout, o_row, p_layout, False, TURNS, KEY_PERM,
        TREE, LATE_K)
    acc, p, m_i, l_i, alpha, vs_prev = _tiles_fp8(
        n_free, n_tiles, acc, p, m_i, l_i, alpha, vs_prev, qf, offs_m, zero_s, q_smem, k_bufs,
        v_bufs, k_ready, v_ready, kv_empty, turn_bars, kv_base, v_base, tile_step, q_start, q_len,
        it0, ME, CAUSAL, BLOCK_N, STAGES, PIN, V_FP8, s_layout, o_row, p_layout, True, TURNS,
        KEY_PERM, TREE, LATE_K)

    last = it0 + n_tiles - 1
    vs = gl.load(v_base + (n_tiles - 1) * tile_step)
    mbarrier.wait(v_ready.index(last % STAGES), (last // STAGES) & 1)
    acc = acc * gl.convert_layout(alpha * (vs_prev / vs), o_row)[:, None]
    p_op = p_operand(p.to(p_dtype), p_layout, KEY_PERM)
    acc_tok = warpgroup_mma(p_op, _v_operand(v_bufs.index(last % STAGES), V_FP8), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc_tok,))
    mbarrier.arrive(kv_empty.index(STAGES + last % STAGES))

    out = (acc * gl.convert_layout(vs / l_i, o_row)[:, None]).to(Out.dtype.element_ty)
    rows = m_row0 + gl.arange(0, ROWS, layout=o_row)
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    ptrs = Out + (q_start + rows).to(gl.int64)[:, None] * stride_ot + head * HEAD_DIM + cols[None, :]
    gl.store(ptrs, out, mask=(rows < q_len)[:, None])

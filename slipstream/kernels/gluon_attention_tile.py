"""Device helpers of the Gluon (sm_90) attention kernels: the TMA producer of
the K/V ring, one online-softmax step and the P.V wait that keeps its place."""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma_wait


@gluon.jit
def load_kv(k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, t, row0, kv_col, pred,
            STAGES: gl.constexpr, BLOCK_N: gl.constexpr):
    """Start the TMA copies of key/value tile t into slot t % STAGES."""
    slot = t % STAGES
    row = row0 + t * BLOCK_N
    mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes, pred)
    tma.async_copy_global_to_shared(k_desc, [row, kv_col], k_ready.index(slot), k_bufs.index(slot), pred)
    mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes, pred)
    tma.async_copy_global_to_shared(v_desc, [row, kv_col], v_ready.index(slot), v_bufs.index(slot), pred)


@gluon.jit
def softmax_tile(s, m_i, l_i, start, offs_m, q_len, mask_from, qk_scale,
                 CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """Online softmax of one score tile (keys start..start+BLOCK_N). m_i is kept
    in log2 units (scaled), so p = exp2(s * scale - m) is one FMA and one MUFU op.
    Only tiles at or past mask_from (causal diagonal, request end) are masked."""
    if start >= mask_from:
        offs_n = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        keep = offs_n[None, :] < q_len
        if CAUSAL:
            keep = keep & (offs_n[None, :] <= offs_m[:, None])
        s = gl.where(keep, s, float("-inf"))
    # Every row sees key 0 in the first tile, so m_new is finite from there on.
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
    p = gl.exp2(s * qk_scale - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, axis=1)
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
def producer(k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, kv_empty, row0, kv_col,
             n_tiles, STAGES: gl.constexpr, BLOCK_N: gl.constexpr):
    """One warp: refill each slot as soon as every consumer has released it."""
    for t in range(n_tiles):
        if t >= STAGES:
            mbarrier.wait(kv_empty.index(t % STAGES), ((t - STAGES) // STAGES) & 1)
        load_kv(k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, t, row0, kv_col, True,
                STAGES, BLOCK_N)

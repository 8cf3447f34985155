"""Prefill attention for Hopper (sm_90) in Gluon, laid out as FlashAttention-3.

Triton 3.6 does not overlap the tensor cores with the softmax on sm_90 (an
early QK^T is waited on at once). Gluon, its lower-level dialect, states the
FA3 structure explicitly:
  * K/V tiles stream through a ring of STAGES shared-memory slots filled by TMA,
    each with a "ready" mbarrier (bytes landed) and, with a producer warp, an
    "empty" one (every consumer is done with the slot);
  * QK^T and P.V are asynchronous wgmma: step j issues S_j = Q K_j^T and then
    O += P_{j-1} V_{j-1} (P straight from registers), waits for S_j only, and
    runs the softmax of S_j while P.V is still on the tensor cores;
  * WS: one producer warp issues every copy; PINGPONG: two consumer warpgroups
    of 64 query rows take turns issuing their GEMMs (two mbarriers pass the
    turn), so one's softmax runs while the other's GEMMs hold the tensor cores.
q [tokens, heads, D], k/v [tokens, kv_heads, D] packed by request (cu_seqlens,
no cached context) are seen by TMA as 2-D [tokens, heads * D]; tile rows past a
request's end (the next request's, or zeros past the tensor) are masked. GQA:
query head h reads KV head h // group. The portable path stays prefill_attention.py.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from slipstream.kernels.gluon_attention_tile import load_kv, producer, retire_pv, softmax_tile

LOG2E = 1.4426950408889634
HEAD_DIMS = (128,)
DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


@gluon.jit
def _consumer(q_smem, k_bufs, v_bufs, k_ready, v_ready, kv_empty, q_bar, turn_bars,
              k_desc, v_desc, o_desc, Out, q_start, q_len, m_row0, head, kv_col, n_tiles,
              mask_from, stride_ot, qk_scale, ME: gl.constexpr,
              CAUSAL: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
              HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, WARPS: gl.constexpr,
              SELF_LOAD: gl.constexpr, PINGPONG: gl.constexpr, PIN: gl.constexpr):
    """ROWS query rows (m_row0.. within the request) against n_tiles key tiles.
    SELF_LOAD: these warps also issue the TMA copies (no producer warp). PIN:
    keep the P.V wait below the softmax (retire_pv); off only to measure it."""
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout([3, 0], [WARPS, 1], [16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout([3, 0], [WARPS, 1], [16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(0, o_layout, 2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    offs_m = m_row0 + gl.arange(0, ROWS, layout=row_layout)
    zero_s = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    turn = 0  # ping-pong: how many times this warpgroup has taken its turn

    # Tile 0: its scores alone, so the loop below always has a P to multiply.
    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_ready.index(0), 0)
    if PINGPONG:
        mbarrier.wait(turn_bars.index(ME), turn & 1)
    s_tok = warpgroup_mma(q_smem, k_bufs.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    if PINGPONG:
        mbarrier.arrive(turn_bars.index(1 - ME))
        turn += 1
    s = warpgroup_mma_wait(0, deps=(s_tok,))
    m_i = gl.full([ROWS], float("-inf"), gl.float32, row_layout)
    l_i = gl.zeros([ROWS], gl.float32, row_layout)
    p, m_i, l_i, alpha = softmax_tile(s, m_i, l_i, 0, offs_m, q_len, mask_from, qk_scale,
                                      CAUSAL, BLOCK_N, s_layout)
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)

    for j in range(1, n_tiles):
        slot = j % STAGES
        prev = (j - 1) % STAGES
        mbarrier.wait(k_ready.index(slot), (j // STAGES) & 1)
        mbarrier.wait(v_ready.index(prev), ((j - 1) // STAGES) & 1)
        if PINGPONG:
            mbarrier.wait(turn_bars.index(ME), turn & 1)
        # Issue S_j = Q K_j^T, rescale O (idle now), issue O += P_{j-1} V_{j-1};
        # the softmax of S_j below runs while P.V is still on the tensor cores.
        s_tok = warpgroup_mma(q_smem, k_bufs.index(slot).permute((1, 0)), zero_s,
                              use_acc=False, is_async=True)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        acc_tok = warpgroup_mma(p_op, v_bufs.index(prev), acc, is_async=True)
        if PINGPONG:
            mbarrier.arrive(turn_bars.index(1 - ME))
            turn += 1
        s = warpgroup_mma_wait(1, deps=(s_tok,))  # wgmma groups retire in order: S_j done
        p, m_i, l_i, alpha = softmax_tile(s, m_i, l_i, j * BLOCK_N, offs_m, q_len, mask_from,
                                          qk_scale, CAUSAL, BLOCK_N, s_layout)
        if PIN:
            acc = retire_pv(acc_tok, p_op, q_start >= 0)
        else:
            acc, p_op = warpgroup_mma_wait(0, deps=(acc_tok, p_op))
        # Tile j - 1 is consumed (K by S_{j-1}, V by the P.V just retired).
        if SELF_LOAD:
            gl.thread_barrier()  # both warpgroups are past it before it is overwritten
            load_kv(k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, j - 1 + STAGES,
                    q_start, kv_col, j - 1 + STAGES < n_tiles, STAGES, BLOCK_N)
        else:
            mbarrier.arrive(kv_empty.index(prev))

    last = (n_tiles - 1) % STAGES
    mbarrier.wait(v_ready.index(last), ((n_tiles - 1) // STAGES) & 1)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    p_op = gl.convert_layout(p.to(dtype), p_layout)
    acc_tok = warpgroup_mma(p_op, v_bufs.index(last), acc, is_async=True)
    acc, p_op = warpgroup_mma_wait(0, deps=(acc_tok, p_op))

    o_row: gl.constexpr = gl.SliceLayout(1, o_layout)
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


@gluon.jit(do_not_specialize=["max_len", "qk_scale", "group"])  # one compile for any batch
def _prefill_kernel(q_desc, k_desc, v_desc, o_desc, Out, CuSeqlens, max_len, stride_ot, qk_scale,
                    group, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                    WS: gl.constexpr, PINGPONG: gl.constexpr, PIN: gl.constexpr,
                    num_warps: gl.constexpr):
    # Latest (longest causal) query blocks first: the grid's tail is short ones.
    head = gl.program_id(1)
    seq = gl.program_id(2)
    q_start = gl.load(CuSeqlens + seq)
    q_len = gl.load(CuSeqlens + seq + 1) - q_start
    m_row0 = (gl.cdiv(max_len, BLOCK_M) - 1 - gl.program_id(0)) * BLOCK_M
    if m_row0 < q_len:
        kv_col = (head // group) * HEAD_DIM
        hi = q_len
        if CAUSAL:
            hi = gl.minimum(q_len, m_row0 + BLOCK_M)
            mask_from = gl.minimum(m_row0 // BLOCK_N * BLOCK_N, q_len // BLOCK_N * BLOCK_N)
        else:
            mask_from = q_len // BLOCK_N * BLOCK_N
        n_tiles = gl.cdiv(hi, BLOCK_N)
        CONSUMERS: gl.constexpr = 2 if PINGPONG else 1
        ROWS: gl.constexpr = BLOCK_M // CONSUMERS

        dtype: gl.constexpr = q_desc.dtype
        q_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, ROWS, HEAD_DIM], q_desc.layout)
        k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(kv_empty.index(i), count=CONSUMERS)  # every consumer releases each slot
        for i in gl.static_range(2):
            mbarrier.init(turn_bars.index(i), count=1)

        # Q (each consumer's rows), then the first STAGES key/value tiles.
        mbarrier.expect(q_bar, CONSUMERS * q_desc.block_type.nbytes)
        for c in gl.static_range(CONSUMERS):
            tma.async_copy_global_to_shared(q_desc, [q_start + m_row0 + c * ROWS, head * HEAD_DIM],
                                            q_bar, q_smem.index(c))
        if not WS:
            for t in gl.static_range(STAGES):
                load_kv(k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, t, q_start, kv_col,
                        t < n_tiles, STAGES, BLOCK_N)
            _consumer(q_smem.index(0), k_bufs, v_bufs, k_ready, v_ready, kv_empty, q_bar,
                      turn_bars, k_desc, v_desc, o_desc, Out, q_start, q_len, m_row0, head,
                      kv_col, n_tiles, mask_from, stride_ot, qk_scale, 0, CAUSAL, ROWS,
                      BLOCK_N, HEAD_DIM, STAGES, num_warps, True, False, PIN)
        elif PINGPONG:
            mbarrier.arrive(turn_bars.index(0))  # the upper rows' warpgroup goes first
            gl.warp_specialize([
                (_consumer, (q_smem.index(0), k_bufs, v_bufs, k_ready, v_ready, kv_empty, q_bar,
                             turn_bars, k_desc, v_desc, o_desc, Out, q_start, q_len, m_row0, head,
                             kv_col, n_tiles, mask_from, stride_ot, qk_scale, 0, CAUSAL,
                             ROWS, BLOCK_N, HEAD_DIM, STAGES, num_warps, False, True, PIN)),
                (_consumer, (q_smem.index(1), k_bufs, v_bufs, k_ready, v_ready, kv_empty, q_bar,
                             turn_bars, k_desc, v_desc, o_desc, Out, q_start, q_len, m_row0 + ROWS,
                             head, kv_col, n_tiles, mask_from, stride_ot, qk_scale, 1,
                             CAUSAL, ROWS, BLOCK_N, HEAD_DIM, STAGES, 4, False, True, PIN)),
                (producer, (k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, kv_empty, q_start,
                            kv_col, n_tiles, STAGES, BLOCK_N)),
            ], [4, 1], [240, 24])
        else:
            gl.warp_specialize([
                (_consumer, (q_smem.index(0), k_bufs, v_bufs, k_ready, v_ready, kv_empty, q_bar,
                             turn_bars, k_desc, v_desc, o_desc, Out, q_start, q_len, m_row0, head,
                             kv_col, n_tiles, mask_from, stride_ot, qk_scale, 0, CAUSAL,
                             ROWS, BLOCK_N, HEAD_DIM, STAGES, num_warps, False, False, PIN)),
                (producer, (k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, kv_empty, q_start,
                            kv_col, n_tiles, STAGES, BLOCK_N)),
            ], [1], [24])


# --- launcher -------------------------------------------------------------------

DEFAULT_CONFIG = {"BLOCK_M": 128, "BLOCK_N": 128, "STAGES": 2, "WS": False, "PINGPONG": False,
                  "PIN": True, "num_warps": 8}


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> None:
    """ValueError for what this kernel does not serve (the caller falls back)."""
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"q, k, v must be [tokens, heads, head_dim], k and v alike: {shapes}")
    tokens, heads, head_dim = q.shape
    if head_dim not in HEAD_DIMS or k.shape[2] != head_dim:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS} for q and k: {shapes}")
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, alike: {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape[0] != tokens or heads % k.shape[1]:
        raise ValueError(f"k needs q's tokens and a divisor of its heads: {shapes}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.stride(2) != 1 or x.stride(1) != head_dim or (x.stride(0) * x.element_size()) % 16 \
                or x.data_ptr() % 16:
            raise ValueError(f"{name} needs strides [*, {head_dim}, 1], 16-byte aligned rows: {x.stride()}")
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 \
            or cu_seqlens.device != q.device:
        raise ValueError("cu_seqlens must be a 1-D int32 tensor [num_seqs + 1] on q's device")


def _descriptor(x: torch.Tensor, rows: int, head_dim: int) -> TensorDescriptor:
    """x [tokens, heads, D] as 2-D [tokens, heads * D] in tiles [rows, D]."""
    layout = gl.NVMMASharedLayout.get_default_for([rows, head_dim], DTYPES[x.dtype])
    return TensorDescriptor(x, [x.shape[0], x.shape[1] * head_dim], [x.stride(0), 1],
                            [rows, head_dim], layout)


def kernel_args(q, k, v, out, cu_seqlens, max_seqlen: int, scale: float, causal: bool, config: dict):
    """(positional args, constexpr kwargs, grid) of one launch; shared with the
    sm_90 compile check, which builds the same arguments on the CPU."""
    cfg = {**DEFAULT_CONFIG, **config}
    head_dim = q.shape[2]
    rows = cfg["BLOCK_M"] // (2 if cfg["PINGPONG"] else 1)
    if cfg["PINGPONG"] and (not cfg["WS"] or cfg["num_warps"] != 4 or rows != 64):
        raise ValueError("PINGPONG needs WS, num_warps 4 and BLOCK_M 128 (64 rows a warpgroup)")
    if rows != 16 * cfg["num_warps"]:
        raise ValueError(f"{rows} rows a consumer need num_warps {rows // 16}")
    args = (_descriptor(q, rows, head_dim), _descriptor(k, cfg["BLOCK_N"], head_dim),
            _descriptor(v, cfg["BLOCK_N"], head_dim), _descriptor(out, rows, head_dim), out,
            cu_seqlens, max_seqlen, out.stride(0), scale * LOG2E, q.shape[1] // k.shape[1])
    consts = dict(HEAD_DIM=head_dim, CAUSAL=causal, **cfg)
    grid = (triton.cdiv(max_seqlen, cfg["BLOCK_M"]), q.shape[1], cu_seqlens.numel() - 1)
    return args, consts, grid


def gluon_prefill_wanted(device: torch.device) -> bool:
    """Whether the backend should try this kernel: opted in with
    SLIPSTREAM_GLUON_PREFILL=1, on an sm_90 GPU."""
    return (os.environ.get("SLIPSTREAM_GLUON_PREFILL", "0") == "1" and device.type == "cuda"
            and _is_sm90(device.index or 0))


@functools.cache
def _is_sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] == 9


def gluon_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                  max_seqlen: int, scale: float, *, causal: bool = True,
                  out: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """Self-attention of packed requests (no cached context), on sm_90.
    q: [tokens, heads, 128]; k, v: [tokens, kv_heads, 128], bf16 or fp16, heads
    contiguous; cu_seqlens: [num_seqs + 1] int32 request starts; max_seqlen: host
    int, the longest request (sizes the grid); config: DEFAULT_CONFIG keys.
    Returns out: [tokens, heads, 128] in q's dtype."""
    check_inputs(q, k, v, cu_seqlens)
    if not q.is_cuda or not _is_sm90(q.device.index or 0):
        raise ValueError("the Gluon prefill kernel needs an sm_90 (Hopper) GPU")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride() != q.stride():
        raise ValueError("out must be shaped, typed and strided like q")
    if max_seqlen <= 0:
        return out
    args, consts, grid = kernel_args(q, k, v, out, cu_seqlens, max_seqlen, scale, causal, config or {})
    _prefill_kernel[grid](*args, **consts)
    return out

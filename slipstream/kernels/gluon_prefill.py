"""Prefill attention for Hopper (sm_90) in Gluon, laid out as FlashAttention-3.

Triton 3.6 does not overlap the tensor cores with the softmax on sm_90 (an
early QK^T is waited on at once). Gluon, its lower-level dialect, states the
FA3 structure explicitly (the per-block loop is gluon_attention_tile.py):
  * K/V tiles stream through a ring of STAGES shared-memory slots filled by TMA,
    each with "ready" and (with a producer warp) "empty" mbarriers;
  * QK^T and P.V are asynchronous wgmma: step j issues S_j = Q K_j^T and then
    O += P_{j-1} V_{j-1} (P straight from registers), waits for S_j only, and
    runs the softmax of S_j while P.V is still on the tensor cores;
  * WS: one producer warp issues every copy; PINGPONG: two consumer warpgroups
    of 64 query rows take turns issuing their GEMMs (two mbarriers pass the turn;
    TURNS=False: no turns), so one's softmax runs under the other's GEMMs;
    PERSISTENT (with WS): one program per SM walks the blocks, Q double-buffered
    (Q_BUFS=1: single, for a third K/V stage), so the next block's Q and first
    K/V tiles land during this one's last tiles.
q [tokens, heads, D], k/v [tokens, kv_heads, D] packed by request (cu_seqlens,
no cached context) are seen by TMA as 2-D [tokens, heads * D]; tile rows past a
request's end (the next request's, or zeros past the tensor) are masked. GQA:
query head h reads KV head h // group. The portable path stays prefill_attention.py.
"""
from __future__ import annotations

import functools
import os

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from slipstream.kernels.attention_tile import LOG2E
from slipstream.kernels.gluon_attention_tile import attend_block, load_kv, produce_block
from slipstream.kernels.gluon_schedule import plan, work_item_kv, work_range
from slipstream.kernels.runtime import num_sms

HEAD_DIMS = (64, 128)
DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


@gluon.jit
def _consume(work, bufs, outs, ME: gl.constexpr, CAUSAL: gl.constexpr,
             BLOCK_M: gl.constexpr,
             ROWS: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
             STAGES: gl.constexpr, Q_SLOTS: gl.constexpr, WARPS: gl.constexpr,
             PINGPONG: gl.constexpr, TURNS: gl.constexpr, PIN: gl.constexpr,
             PERSISTENT: gl.constexpr, SNAKE: gl.constexpr, HEAD_GROUP: gl.constexpr,
             TABLE: gl.constexpr, PAGED: gl.constexpr, TREE: gl.constexpr, LATE_K: gl.constexpr):
    """A consumer warpgroup (set) over item slots t0, t0 + t_step, .. < t_end (gluon_schedule).
    work, bufs, outs: the kernel's tuples (_prefill_kernel)."""
    t0, t_end, t_step, total, CuSeqlens, Items, n_mblocks, heads, num_seqs, group, KvLens = work
    q_smem, q_ready, q_empty, k_bufs, v_bufs, k_ready, v_ready, kv_empty, turn_bars = bufs
    k_desc, v_desc, o_desc, Out, stride_ot, qk_scale = outs
    CONSUMERS: gl.constexpr = BLOCK_M // ROWS
    it0 = 0  # K/V tiles done so far (the ring position)
    k = 0    # blocks done so far (the Q slot)
    for t in range(t0, t_end, t_step):
        q_start, q_len, m_row0, head, kv_col, n_tiles, mask_from, seq, ctx = work_item_kv(
            t, total, CuSeqlens, KvLens, Items, n_mblocks, heads, num_seqs, group, BLOCK_M,
            BLOCK_N, HEAD_DIM, CAUSAL, PERSISTENT, SNAKE, HEAD_GROUP, TABLE, PAGED)
        if n_tiles > 0:
            qs = k % Q_SLOTS
            attend_block(q_smem.index(qs * CONSUMERS + ME), q_ready.index(qs), (k // Q_SLOTS) & 1,
                         k_bufs, v_bufs, k_ready, v_ready, kv_empty, turn_bars, k_desc, v_desc,
                         o_desc, Out, q_start, q_len, m_row0 + ME * ROWS, head, kv_col, n_tiles,
                         it0, mask_from, stride_ot, qk_scale, ctx, 0, 0, ME, CAUSAL, ROWS,
                         BLOCK_N, HEAD_DIM, STAGES, WARPS, False, TURNS, PIN, PAGED, BLOCK_N, TREE, LATE_K)
            mbarrier.arrive(q_empty.index(qs))  # Q's slot (and the output staged in it) is free
            it0 += n_tiles
            k += 1


@gluon.jit
def _produce(work, loads, BlockTables, stride_bt, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, ROWS: gl.constexpr,
             BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
             Q_SLOTS: gl.constexpr, CONSUMERS: gl.constexpr, PERSISTENT: gl.constexpr,
             SNAKE: gl.constexpr, HEAD_GROUP: gl.constexpr, TABLE: gl.constexpr,
             PAGED: gl.constexpr, PAGE: gl.constexpr):
    """The producer warp over the same work items: each block's Q, then its K/V.
    With one Q buffer (persistent), a later block's first STAGES tiles go first:
    its Q must wait for the previous block's end, its K/V only for ring slots. work, loads:
    the kernel's tuples."""
    t0, t_end, t_step, total, CuSeqlens, Items, n_mblocks, heads, num_seqs, group, KvLens = work
    q_desc, q_smem, q_ready, q_empty, k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, kv_empty = loads
    it0 = 0
    k = 0
    for t in range(t0, t_end, t_step):
        q_start, q_len, m_row0, head, kv_col, n_tiles, mask_from, seq, ctx = work_item_kv(
            t, total, CuSeqlens, KvLens, Items, n_mblocks, heads, num_seqs, group, BLOCK_M,
            BLOCK_N, HEAD_DIM, CAUSAL, PERSISTENT, SNAKE, HEAD_GROUP, TABLE, PAGED)
        table = BlockTables + seq.to(gl.int64) * stride_bt
        n_pages = gl.cdiv(ctx + q_len, PAGE)
        if n_tiles > 0:
            qs = k % Q_SLOTS
            early = 0
            if Q_SLOTS == 1:
                early = gl.minimum(n_tiles, STAGES) * (k > 0).to(gl.int32)
                produce_block(k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, kv_empty, q_start,
                              kv_col, 0, early, it0, table, n_pages, STAGES, BLOCK_N, PAGED, PAGE)
            if k >= Q_SLOTS:
                mbarrier.wait(q_empty.index(qs), ((k - Q_SLOTS) // Q_SLOTS) & 1)
            mbarrier.expect(q_ready.index(qs), CONSUMERS * q_desc.block_type.nbytes)
            for c in gl.static_range(CONSUMERS):
                tma.async_copy_global_to_shared(q_desc, [q_start + m_row0 + c * ROWS, head * HEAD_DIM],
                                                q_ready.index(qs), q_smem.index(qs * CONSUMERS + c))
            produce_block(k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, kv_empty, q_start,
                          kv_col, early, n_tiles, it0, table, n_pages, STAGES, BLOCK_N, PAGED, PAGE)
            it0 += n_tiles
            k += 1


@gluon.jit(do_not_specialize=["max_len", "qk_scale", "group", "heads", "num_seqs", "stride_bt"])
def _prefill_kernel(q_desc, k_desc, v_desc, o_desc, Out, CuSeqlens, Items, max_len, stride_ot,
                    qk_scale, group, heads, num_seqs, KvLens, BlockTables, stride_bt,
                    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                    WS: gl.constexpr, PINGPONG: gl.constexpr, TURNS: gl.constexpr,
                    PERSISTENT: gl.constexpr, Q_BUFS: gl.constexpr, PIN: gl.constexpr,
                    SNAKE: gl.constexpr, HEAD_GROUP: gl.constexpr, TABLE: gl.constexpr,
                    PAGED: gl.constexpr, PAGE: gl.constexpr, TREE: gl.constexpr,
                    LATE_K: gl.constexpr, num_warps: gl.constexpr):
    n_mblocks = gl.cdiv(max_len, BLOCK_M)
    # persistent: one program per SM over every block; else grid (query block, head, request)
    t0, t_end, t_step, total = work_range(n_mblocks, heads, num_seqs, Items, PERSISTENT, SNAKE, TABLE)
    CONSUMERS: gl.constexpr = BLOCK_M // 64 if PINGPONG else 1  # 2, or 3 (BLOCK_M 192, no turns)
    ROWS: gl.constexpr = BLOCK_M // CONSUMERS
    Q_SLOTS: gl.constexpr = Q_BUFS if PERSISTENT else 1
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [Q_SLOTS * CONSUMERS, ROWS, HEAD_DIM], q_desc.layout)
    # Paged, a tile's slot takes its pages' copies (k_desc's layout is the whole tile's).
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [2 * STAGES, 1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [Q_SLOTS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [Q_SLOTS, 1], mbarrier.MBarrierLayout())
    turn_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=CONSUMERS)  # every consumer releases K
        mbarrier.init(kv_empty.index(STAGES + i), count=CONSUMERS)  # and V
    for i in gl.static_range(Q_SLOTS):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=CONSUMERS)
    for i in gl.static_range(2):
        mbarrier.init(turn_bars.index(i), count=1)

    if not WS:  # these warps copy too: Q and the first STAGES tiles, then the loop
        q_start, q_len, m_row0, head, kv_col, n_tiles, mask_from, seq, ctx = work_item_kv(
            t0, total, CuSeqlens, KvLens, Items, n_mblocks, heads, num_seqs, group, BLOCK_M,
            BLOCK_N, HEAD_DIM, CAUSAL, False, False, HEAD_GROUP, TABLE, PAGED)
        table = BlockTables + seq.to(gl.int64) * stride_bt
        n_pages = gl.cdiv(ctx + q_len, PAGE)
        if n_tiles > 0:
            mbarrier.expect(q_ready.index(0), q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [q_start + m_row0, head * HEAD_DIM],
                                            q_ready.index(0), q_smem.index(0))
            for i in gl.static_range(STAGES):
                load_kv(k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, i,
                        q_start + i * BLOCK_N, kv_col, i < n_tiles, table, i, n_pages, STAGES,
                        PAGED, PAGE, BLOCK_N)
            attend_block(q_smem.index(0), q_ready.index(0), 0, k_bufs, v_bufs, k_ready, v_ready,
                         kv_empty, turn_bars, k_desc, v_desc, o_desc, Out, q_start, q_len, m_row0,
                         head, kv_col, n_tiles, 0, mask_from, stride_ot, qk_scale, ctx, table,
                         n_pages, 0, CAUSAL, ROWS, BLOCK_N, HEAD_DIM, STAGES, num_warps, True,
                         False, PIN, PAGED, PAGE, TREE, LATE_K)
    else:
        work = (t0, t_end, t_step, total, CuSeqlens, Items, n_mblocks, heads, num_seqs, group, KvLens)
        bufs = (q_smem, q_ready, q_empty, k_bufs, v_bufs, k_ready, v_ready, kv_empty, turn_bars)
        outs = (k_desc, v_desc, o_desc, Out, stride_ot, qk_scale)
        loads = (q_desc, q_smem, q_ready, q_empty, k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, kv_empty)
        if CONSUMERS == 3:  # 13 warps: 3 x 128 x 152 + 32 x 24 registers fit the SM's 64K
            gl.warp_specialize([(_consume, (work, bufs, outs, 0, CAUSAL, BLOCK_M, ROWS, BLOCK_N, HEAD_DIM, STAGES, Q_SLOTS,
                            num_warps, True, False, PIN, PERSISTENT, SNAKE, HEAD_GROUP, TABLE, PAGED, TREE, LATE_K)),
                                (_consume, (work, bufs, outs, 1, CAUSAL, BLOCK_M, ROWS, BLOCK_N, HEAD_DIM, STAGES, Q_SLOTS,
                            4, True, False, PIN, PERSISTENT, SNAKE, HEAD_GROUP, TABLE, PAGED, TREE, LATE_K)),
                                (_consume, (work, bufs, outs, 2, CAUSAL, BLOCK_M, ROWS, BLOCK_N, HEAD_DIM, STAGES, Q_SLOTS,
                            4, True, False, PIN, PERSISTENT, SNAKE, HEAD_GROUP, TABLE, PAGED, TREE, LATE_K)),
                                (_produce, (work, loads, BlockTables, stride_bt, CAUSAL, BLOCK_M, ROWS, BLOCK_N, HEAD_DIM, STAGES,
                            Q_SLOTS, CONSUMERS, PERSISTENT, SNAKE, HEAD_GROUP, TABLE, PAGED, PAGE))], [4, 4, 1], [152, 152, 24])
        elif PINGPONG:
            mbarrier.arrive(turn_bars.index(0))  # the upper rows' warpgroup goes first
            gl.warp_specialize([(_consume, (work, bufs, outs, 0, CAUSAL, BLOCK_M, ROWS, BLOCK_N, HEAD_DIM, STAGES, Q_SLOTS,
                            num_warps, True, TURNS, PIN, PERSISTENT, SNAKE, HEAD_GROUP, TABLE, PAGED, TREE, LATE_K)),
                                (_consume, (work, bufs, outs, 1, CAUSAL, BLOCK_M, ROWS, BLOCK_N, HEAD_DIM, STAGES, Q_SLOTS,
                            4, True, TURNS, PIN, PERSISTENT, SNAKE, HEAD_GROUP, TABLE, PAGED, TREE, LATE_K)),
                                (_produce, (work, loads, BlockTables, stride_bt, CAUSAL, BLOCK_M, ROWS, BLOCK_N, HEAD_DIM, STAGES,
                            Q_SLOTS, CONSUMERS, PERSISTENT, SNAKE, HEAD_GROUP, TABLE, PAGED, PAGE))], [4, 1], [240, 24])
        else:
            gl.warp_specialize([(_consume, (work, bufs, outs, 0, CAUSAL, BLOCK_M, ROWS, BLOCK_N, HEAD_DIM, STAGES, Q_SLOTS,
                            num_warps, False, False, PIN, PERSISTENT, SNAKE, HEAD_GROUP, TABLE, PAGED, TREE, LATE_K)),
                                (_produce, (work, loads, BlockTables, stride_bt, CAUSAL, BLOCK_M, ROWS, BLOCK_N, HEAD_DIM, STAGES,
                            Q_SLOTS, CONSUMERS, PERSISTENT, SNAKE, HEAD_GROUP, TABLE, PAGED, PAGE))], [1], [24])


# --- launcher -------------------------------------------------------------------

DEFAULT_CONFIG = {"BLOCK_M": 128, "BLOCK_N": 128, "STAGES": 2, "WS": False, "PINGPONG": False,
                  "TURNS": True, "PERSISTENT": False, "Q_BUFS": 2, "PIN": True, "SNAKE": False,
                  "HEAD_GROUP": 0, "TABLE": False, "TREE": False, "LATE_K": False,
                  "num_warps": 8}  # SNAKE..TABLE: gluon_schedule.py
# A call without `config` (H200, GLUON.md): ping-pong, 2 stages; persistent with the snake
# order up to 4k tokens a request (+8% at 4k causal over round robin), not past (grid best).
CHOSEN = {"PERSISTENT_UP_TO": 4096, "config": {"WS": True, "PINGPONG": True, "num_warps": 4}}


def _check_rows(name: str, x: torch.Tensor, head_dim: int) -> None:
    """x [tokens, heads, D]: heads contiguous, rows 16-byte aligned (TMA's 2-D view)."""
    if x.stride(2) != 1 or x.stride(1) != head_dim or (x.stride(0) * x.element_size()) % 16 \
            or x.data_ptr() % 16:
        raise ValueError(f"{name} needs strides [*, {head_dim}, 1], 16-byte aligned rows: {x.stride()}")


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
        _check_rows(name, x, head_dim)
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 \
            or cu_seqlens.device != q.device:
        raise ValueError("cu_seqlens must be a 1-D int32 tensor [num_seqs + 1] on q's device")


def _descriptor(x: torch.Tensor, rows: int, head_dim: int) -> TensorDescriptor:
    """x [tokens, heads, D] as 2-D [tokens, heads * D] in tiles [rows, D]."""
    layout = gl.NVMMASharedLayout.get_default_for([rows, head_dim], DTYPES[x.dtype])
    return TensorDescriptor(x, [x.shape[0], x.shape[1] * head_dim], [x.stride(0), 1],
                            [rows, head_dim], layout)


def _cache_descriptor(cache: torch.Tensor, page_rows: int, block_n: int, head_dim: int) -> TensorDescriptor:
    """A paged cache [blocks, page, kv_heads, D] as 2-D [blocks * page, kv_heads * D] in
    copies of [page_rows, D], laid out in shared memory as a whole [block_n, D] tile."""
    layout = gl.NVMMASharedLayout.get_default_for([block_n, head_dim], DTYPES[cache.dtype])
    blocks, page, kv_heads, _ = cache.shape
    return TensorDescriptor(cache, [blocks * page, kv_heads * head_dim], [kv_heads * head_dim, 1],
                            [page_rows, head_dim], layout)


def kernel_args(q, k, v, out, cu_seqlens, max_seqlen: int, scale: float, causal: bool, config: dict,
                lengths=None, paged=None):
    """(positional args, constexpr kwargs, grid) of one launch; shared with the
    sm_90 compile check, which builds the same arguments on the CPU. lengths: the
    requests' lengths as host ints (config TABLE: gluon_schedule.plan). paged:
    (kv_lens, block_tables) when k / v are paged caches [blocks, page, kv_heads, D]."""
    unknown = set(config) - set(DEFAULT_CONFIG)
    if unknown:
        raise ValueError(f"unknown config keys {sorted(unknown)}; known: {sorted(DEFAULT_CONFIG)}")
    cfg = {**DEFAULT_CONFIG, **config}
    head_dim = q.shape[2]
    rows = 64 if cfg["PINGPONG"] else cfg["BLOCK_M"]
    if cfg["PINGPONG"] and (not cfg["WS"] or cfg["num_warps"] != 4 or cfg["BLOCK_M"] not in (128, 192)):
        raise ValueError("PINGPONG needs WS, num_warps 4 and BLOCK_M 128 or 192 (two or three "
                         "warpgroups of 64 rows)")
    if cfg["PINGPONG"] and cfg["BLOCK_M"] == 192 and cfg["TURNS"]:
        raise ValueError("three consumer warpgroups (BLOCK_M 192) run without TURNS")
    if cfg["PERSISTENT"] and not cfg["WS"]:
        raise ValueError("PERSISTENT needs WS (the producer warp walks the blocks ahead)")
    if (cfg["SNAKE"] and not cfg["PERSISTENT"]) or cfg["HEAD_GROUP"] < 0:
        raise ValueError("SNAKE needs PERSISTENT, HEAD_GROUP >= 0 (gluon_schedule.py)")
    if rows != 16 * cfg["num_warps"]:
        raise ValueError(f"{rows} rows a consumer need num_warps {rows // 16}")
    if paged is not None and cfg["TABLE"]:
        raise ValueError("TABLE orders whole prompts; paged K/V runs without it")
    items, grid = plan(cfg, lengths, max_seqlen, q.shape[1], cu_seqlens, causal,
                       num_sms(q.device.index or 0) if q.is_cuda else 132)
    block_n = cfg["BLOCK_N"]
    if paged is None:
        kv_heads, page = k.shape[1], block_n
        kv_descs = (_descriptor(k, block_n, head_dim), _descriptor(v, block_n, head_dim))
        extra = (cu_seqlens, cu_seqlens, 0)
    else:
        kv_lens, tables = paged
        kv_heads, page = k.shape[2], k.shape[1]
        kv_descs = tuple(_cache_descriptor(c, min(page, block_n), block_n, head_dim) for c in (k, v))
        extra = (kv_lens, tables, tables.stride(0))
    args = (_descriptor(q, rows, head_dim), *kv_descs, _descriptor(out, rows, head_dim), out,
            cu_seqlens, items, max_seqlen, out.stride(0), scale * LOG2E, q.shape[1] // kv_heads,
            q.shape[1], cu_seqlens.numel() - 1, *extra)
    return args, dict(HEAD_DIM=head_dim, CAUSAL=causal, PAGED=paged is not None, PAGE=page,
                      **cfg), grid


def gluon_prefill_wanted(device: torch.device) -> bool:
    """Whether the backend should try this kernel: on an sm_90 GPU, unless
    SLIPSTREAM_GLUON_PREFILL=0 (=fp8: its FP8 version for whole prompts)."""
    return (os.environ.get("SLIPSTREAM_GLUON_PREFILL", "1") in ("1", "fp8") and device.type == "cuda"
            and _is_sm90(device.index or 0))


@functools.cache
def _is_sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] == 9


def _output_for(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """`out` checked (a new tensor when None): shaped and typed like q, rows 16-byte aligned."""
    if out is None:
        return torch.empty_like(q)
    if out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1 \
            or out.stride(1) != q.shape[2] or (out.stride(0) * out.element_size()) % 16 or out.data_ptr() % 16:
        raise ValueError("out must be shaped and typed like q, heads contiguous, rows 16-byte aligned")
    return out


def gluon_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                  max_seqlen: int, scale: float, *, causal: bool = True,
                  out: torch.Tensor | None = None, config: dict | None = None,
                  lengths=None) -> torch.Tensor:
    """Self-attention of packed requests (no cached context), on sm_90.
    q: [tokens, heads, D]; k, v: [tokens, kv_heads, D], D in HEAD_DIMS, bf16 or fp16, heads
    contiguous; cu_seqlens: [num_seqs + 1] int32 request starts; max_seqlen: host
    int, the longest request (sizes the grid); config: DEFAULT_CONFIG keys (None: CHOSEN);
    lengths: the request lengths as host ints (config TABLE needs them).
    Returns out: [tokens, heads, D] in q's dtype."""
    check_inputs(q, k, v, cu_seqlens)
    if not q.is_cuda or not _is_sm90(q.device.index or 0):
        raise ValueError("the Gluon prefill kernel needs an sm_90 (Hopper) GPU")
    out = _output_for(q, out)
    if max_seqlen <= 0 or q.shape[0] == 0:
        return out
    if config is None:
        persistent = max_seqlen <= CHOSEN["PERSISTENT_UP_TO"]
        config = {**CHOSEN["config"], "PERSISTENT": persistent, "SNAKE": persistent}
    args, consts, grid = kernel_args(q, k, v, out, cu_seqlens, max_seqlen, scale, causal, config, lengths)
    if grid[0]:
        _prefill_kernel[grid](*args, **consts)
    return out


def check_paged_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       cu_seqlens: torch.Tensor, kv_lens: torch.Tensor,
                       block_tables: torch.Tensor, block_n: int) -> None:
    """ValueError for what the paged kernel does not serve (the caller falls back)."""
    shapes = f"q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}"
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"q must be [tokens, heads, D], the caches [blocks, page, kv_heads, D]: {shapes}")
    heads, head_dim = q.shape[1], q.shape[2]
    page, kv_heads = k_cache.shape[1], k_cache.shape[2]
    if head_dim not in HEAD_DIMS or k_cache.shape[3] != head_dim or heads % kv_heads:
        raise ValueError(f"head_dim one of {HEAD_DIMS} for q and the caches, KV heads dividing "
                         f"the heads: {shapes}")
    if q.dtype not in DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, alike: {q.dtype}, {k_cache.dtype}")
    if page % 8 or (page % block_n and block_n % page):
        raise ValueError(f"a page of {page} tokens: a multiple of 8 that divides, or is divided "
                         f"by, the key tile ({block_n})")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or k_cache.data_ptr() % 16 \
            or v_cache.data_ptr() % 16:
        raise ValueError("the caches must be contiguous and 16-byte aligned")
    _check_rows("q", q, head_dim)
    n = cu_seqlens.numel() - 1
    if cu_seqlens.dtype != torch.int32 or kv_lens.dtype != torch.int32 or kv_lens.shape != (n,) \
            or block_tables.dtype != torch.int32 or block_tables.dim() != 2 \
            or block_tables.shape[0] != n or block_tables.stride(1) != 1:
        raise ValueError("cu_seqlens [n + 1], kv_lens [n] and block_tables [n, pages] must be int32 "
                         "(block_tables rows contiguous)")


def gluon_prefill_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        cu_seqlens: torch.Tensor, kv_lens: torch.Tensor,
                        block_tables: torch.Tensor, max_seqlen: int, scale: float, *,
                        causal: bool = True, out: torch.Tensor | None = None,
                        config: dict | None = None) -> torch.Tensor:
    """The queries of packed requests against their keys in a paged cache (the
    engine's layout: [blocks, page, kv_heads, D], the step's own K/V already
    stored), on sm_90. Request i has kv_lens[i] keys, its cached context first,
    and its queries (cu_seqlens) are the last of them; block_tables[i] lists its
    pages. max_seqlen: the longest query (host int). Slots past a request's keys
    in its last page are read and masked: they must hold finite values (the
    engine's pool does: zeros, or K/V it wrote), as 0 x NaN is NaN in P.V.
    Otherwise as gluon_prefill (config default: CHOSEN's, not persistent)."""
    cfg = {**CHOSEN["config"], "PERSISTENT": False} if config is None else config
    check_paged_inputs(q, k_cache, v_cache, cu_seqlens, kv_lens, block_tables,
                       {**DEFAULT_CONFIG, **cfg}["BLOCK_N"])
    if not q.is_cuda or not _is_sm90(q.device.index or 0):
        raise ValueError("the Gluon prefill kernel needs an sm_90 (Hopper) GPU")
    out = _output_for(q, out)
    if max_seqlen <= 0 or q.shape[0] == 0:
        return out
    args, consts, grid = kernel_args(q, k_cache, v_cache, out, cu_seqlens, max_seqlen, scale,
                                     causal, cfg, paged=(kv_lens, block_tables))
    if grid[0]:
        _prefill_kernel[grid](*args, **consts)
    return out

"""FP8 (e4m3) prefill attention for Hopper (sm_90) in Gluon: both GEMMs on the
FP8 tensor cores, FlashAttention-3's structure (gluon_prefill.py: a TMA producer
warp, two consumer warpgroups in ping-pong, the next scores issued before this
softmax, optionally persistent). The per-block loop is gluon_fp8_tile.py.

Inputs come from `quantize_fp8_inputs` (gluon_fp8_inputs.py): Q, K in e4m3 with
block scales (after the rotation of the existing FP8 path, fp8_attention.py), V
transposed to V^T [kv_heads * D, tokens] in e4m3 with one scale per BLOCK_N
tokens: FP8 wgmma reads its shared-memory operands K-major only, and for P.V the
reduction runs over the tokens. Why P and V in FP8 (not P bf16 against V
dequantized): wgmma's B comes from shared memory, so bf16 V would mean a second,
dequantized copy in shared memory, and P.V (half the FLOPs) would stay at bf16
speed: at most 4/3 of bf16 overall, short of the 1.5x asked.
"""
from __future__ import annotations

import os

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from slipstream.kernels.gluon_fp8_inputs import Fp8Inputs
from slipstream.kernels.gluon_fp8_tile import attend_block_fp8, produce_block_fp8
from slipstream.kernels.gluon_prefill import HEAD_DIMS, LOG2E, _is_sm90
from slipstream.kernels.gluon_schedule import plan, work_item, work_range
from slipstream.kernels.runtime import num_sms

FP8 = torch.float8_e4m3fn
OUT_DTYPES = (torch.bfloat16, torch.float16)


@gluon.jit
def _consume(work, bufs, outs, ME: gl.constexpr, CAUSAL: gl.constexpr,
             BLOCK_M: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
             HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, Q_SLOTS: gl.constexpr,
             PIN: gl.constexpr, PERSISTENT: gl.constexpr, SNAKE: gl.constexpr,
             HEAD_GROUP: gl.constexpr, TABLE: gl.constexpr, V_FP8: gl.constexpr,
             TURNS: gl.constexpr, KEY_PERM: gl.constexpr, TREE: gl.constexpr,
             LATE_K: gl.constexpr):
    """One consumer warpgroup (ME: its 64 rows of each block) over work items t0, t0 + t_step, ..
    (BLOCK_M // ROWS consumers share each block's K / V tiles). work, bufs, outs: the kernel's
    tuples (_fp8_prefill_kernel)."""
    t0, t_end, t_step, total, CuSeqlens, Items, n_mblocks, heads, num_seqs, kv_heads, group = work
    q_smem, q_ready, q_empty, k_bufs, v_bufs, k_ready, v_ready, kv_empty, turn_bars = bufs
    Out, QScale, KScale, VScale, stride_ot, qk_scale = outs
    it0 = 0
    k = 0
    for t in range(t0, t_end, t_step):
        q_start, q_len, m_row0, head, kv_col, n_tiles, mask_from, seq = work_item(
            t, total, CuSeqlens, Items, n_mblocks, heads, num_seqs, group, BLOCK_M, BLOCK_N, HEAD_DIM,
            CAUSAL, PERSISTENT, SNAKE, HEAD_GROUP, TABLE)
        if n_tiles > 0:
            qs = k % Q_SLOTS
            attend_block_fp8(q_smem.index(qs * (BLOCK_M // ROWS) + ME), q_ready.index(qs), (k // Q_SLOTS) & 1,
                             k_bufs, v_bufs, k_ready, v_ready, kv_empty, turn_bars, Out, QScale,
                             KScale, VScale, q_start, q_len, m_row0 + ME * ROWS, head, heads,
                             head // group, kv_heads, n_tiles, it0, mask_from, stride_ot,
                             qk_scale, ME, CAUSAL, ROWS, BLOCK_N, HEAD_DIM, STAGES, 4, PIN, V_FP8, TURNS,
                             KEY_PERM, TREE, LATE_K)
            mbarrier.arrive(q_empty.index(qs))
            it0 += n_tiles
            k += 1


@gluon.jit
def _produce(work, VStarts, loads, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, ROWS: gl.constexpr,
             BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
             Q_SLOTS: gl.constexpr, PERSISTENT: gl.constexpr, SNAKE: gl.constexpr,
             HEAD_GROUP: gl.constexpr, TABLE: gl.constexpr, V_FP8: gl.constexpr):
    """The producer warp: each block's Q parts (one a consumer), then its K / V^T tiles
    (with one Q buffer, a later block's first STAGES tiles before its Q). work, loads: the
    kernel's tuples."""
    t0, t_end, t_step, total, CuSeqlens, Items, n_mblocks, heads, num_seqs, kv_heads, group = work
    q_desc, q_smem, q_ready, q_empty, k_desc, vt_desc, k_bufs, v_bufs, k_ready, v_ready, kv_empty = loads
    it0 = 0
    k = 0
    for t in range(t0, t_end, t_step):
        q_start, q_len, m_row0, head, kv_col, n_tiles, mask_from, seq = work_item(
            t, total, CuSeqlens, Items, n_mblocks, heads, num_seqs, group, BLOCK_M, BLOCK_N, HEAD_DIM,
            CAUSAL, PERSISTENT, SNAKE, HEAD_GROUP, TABLE)
        if n_tiles > 0:
            qs = k % Q_SLOTS
            early = 0
            v_start = q_start  # V^T: the request's first column (a multiple of 16: TMA)
            if V_FP8:
                v_start = gl.load(VStarts + seq)
            if Q_SLOTS == 1:
                early = gl.minimum(n_tiles, STAGES) * (k > 0).to(gl.int32)
                produce_block_fp8(k_desc, vt_desc, k_bufs, v_bufs, k_ready, v_ready, kv_empty,
                                  q_start, v_start, kv_col, 0, early, it0, STAGES, BLOCK_N, V_FP8)
            if k >= Q_SLOTS:
                mbarrier.wait(q_empty.index(qs), ((k - Q_SLOTS) // Q_SLOTS) & 1)
            CONSUMERS: gl.constexpr = BLOCK_M // ROWS
            mbarrier.expect(q_ready.index(qs), CONSUMERS * q_desc.block_type.nbytes)
            for c in gl.static_range(CONSUMERS):
                tma.async_copy_global_to_shared(q_desc, [q_start + m_row0 + c * ROWS, head * HEAD_DIM],
                                                q_ready.index(qs), q_smem.index(qs * CONSUMERS + c))
            produce_block_fp8(k_desc, vt_desc, k_bufs, v_bufs, k_ready, v_ready, kv_empty, q_start,
                              v_start, kv_col, early, n_tiles, it0, STAGES, BLOCK_N, V_FP8)
            it0 += n_tiles
            k += 1


@gluon.jit(do_not_specialize=["max_len", "qk_scale", "group", "heads", "kv_heads", "num_seqs"])
def _fp8_prefill_kernel(q_desc, k_desc, vt_desc, Out, QScale, KScale, VScale, CuSeqlens, Items,
                        VStarts, max_len, stride_ot, qk_scale, group, heads, kv_heads, num_seqs,
                        HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                        STAGES: gl.constexpr, CAUSAL: gl.constexpr, PERSISTENT: gl.constexpr,
                        Q_BUFS: gl.constexpr, PIN: gl.constexpr, SNAKE: gl.constexpr,
                        HEAD_GROUP: gl.constexpr, TABLE: gl.constexpr, V_FP8: gl.constexpr,
                        TURNS: gl.constexpr, KEY_PERM: gl.constexpr, TREE: gl.constexpr,
                        LATE_K: gl.constexpr, num_warps: gl.constexpr):
    n_mblocks = gl.cdiv(max_len, BLOCK_M)
    t0, t_end, t_step, total = work_range(n_mblocks, heads, num_seqs, Items, PERSISTENT, SNAKE, TABLE)
    ROWS: gl.constexpr = 64                     # a consumer warpgroup's rows
    CONSUMERS: gl.constexpr = BLOCK_M // ROWS   # 2
    Q_SLOTS: gl.constexpr = Q_BUFS if PERSISTENT else 1
    q_smem = gl.allocate_shared_memory(gl.float8e4nv, [Q_SLOTS * CONSUMERS, ROWS, HEAD_DIM], q_desc.layout)
    k_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_tile: gl.constexpr = vt_desc.block_type.shape  # V^T's [D, BLOCK_N], or V's [BLOCK_N, D]
    v_bufs = gl.allocate_shared_memory(vt_desc.dtype, [STAGES, v_tile[0], v_tile[1]], vt_desc.layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [2 * STAGES, 1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [Q_SLOTS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [Q_SLOTS, 1], mbarrier.MBarrierLayout())
    turn_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=CONSUMERS)
        mbarrier.init(kv_empty.index(STAGES + i), count=CONSUMERS)
    for i in gl.static_range(Q_SLOTS):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=CONSUMERS)
    for i in gl.static_range(2):
        mbarrier.init(turn_bars.index(i), count=1)
    mbarrier.arrive(turn_bars.index(0))  # the upper rows' warpgroup goes first
    work = (t0, t_end, t_step, total, CuSeqlens, Items, n_mblocks, heads, num_seqs, kv_heads, group)
    bufs = (q_smem, q_ready, q_empty, k_bufs, v_bufs, k_ready, v_ready, kv_empty, turn_bars)
    outs = (Out, QScale, KScale, VScale, stride_ot, qk_scale)
    loads = (q_desc, q_smem, q_ready, q_empty, k_desc, vt_desc, k_bufs, v_bufs, k_ready, v_ready, kv_empty)
    gl.warp_specialize([
        (_consume, (work, bufs, outs, 0, CAUSAL, BLOCK_M, ROWS, BLOCK_N, HEAD_DIM, STAGES, Q_SLOTS, PIN,
                    PERSISTENT, SNAKE, HEAD_GROUP, TABLE, V_FP8, TURNS, KEY_PERM, TREE, LATE_K)),
        (_consume, (work, bufs, outs, 1, CAUSAL, BLOCK_M, ROWS, BLOCK_N, HEAD_DIM, STAGES, Q_SLOTS, PIN,
                    PERSISTENT, SNAKE, HEAD_GROUP, TABLE, V_FP8, TURNS, KEY_PERM, TREE, LATE_K)),
        (_produce, (work, VStarts, loads, CAUSAL, BLOCK_M, ROWS, BLOCK_N, HEAD_DIM, STAGES, Q_SLOTS,
                    PERSISTENT, SNAKE, HEAD_GROUP, TABLE, V_FP8))], [4, 1], [240, 24])


# --- launcher -------------------------------------------------------------------

DEFAULT_CONFIG = {"BLOCK_M": 128, "BLOCK_N": 128, "STAGES": 2, "PERSISTENT": False, "Q_BUFS": 2,
                  "PIN": True, "SNAKE": False, "HEAD_GROUP": 0, "TABLE": False, "TURNS": False,
                  "TREE": False, "LATE_K": False, "num_warps": 4}  # SNAKE..TABLE: gluon_schedule.py
# TURNS off: each warpgroup issues its (short, FP8) GEMMs when ready; faster than ping-pong
# turns on every shape of the H200 runs of 2026-12-03 (1-4%, GLUON_FP8.md)
PERSISTENT_UP_TO = 4096  # as the bf16 kernel (GLUON.md): persistent (snake order) up to 4k


GL_DTYPES = {FP8: gl.float8e4nv, torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


def _descriptor(x: torch.Tensor, block: list[int]) -> TensorDescriptor:
    layout = gl.NVMMASharedLayout.get_default_for(block, GL_DTYPES[x.dtype])
    return TensorDescriptor(x, list(x.shape), [x.stride(0), 1], block, layout)


def check_fp8_inputs(x: Fp8Inputs, cu_seqlens: torch.Tensor, block_n: int) -> None:
    """ValueError for inputs this kernel does not take (shapes as quantize_fp8_inputs makes)."""
    q8, k8, vt8, q_scale, k_scale, v_scale, kv_block, v_starts, _, key_perm = x
    shapes = f"q {tuple(q8.shape)}, k {tuple(k8.shape)}, v {tuple(vt8.shape)}"
    if q8.dim() != 3 or k8.dim() != 3 or vt8.dim() != (2 if vt8.dtype == FP8 else 3):
        raise ValueError(f"q, k must be [tokens, heads, D], v^T [kv_heads * D, tokens] e4m3 "
                         f"(or v like k in bf16 / fp16): {shapes}")
    tokens, heads, d = q8.shape
    if d not in HEAD_DIMS or k8.shape[2] != d or k8.shape[0] != tokens or heads % k8.shape[1]:
        raise ValueError(f"head_dim in {HEAD_DIMS}, k with q's tokens and a divisor of its heads: {shapes}")
    if vt8.dtype == FP8 and (vt8.shape[0] != k8.shape[1] * d or vt8.shape[1] < tokens or vt8.shape[1] % 16):
        raise ValueError(f"v^T must be [kv_heads * D, columns (a multiple of 16)]: {shapes}")
    if v_starts.dtype != torch.int32 or v_starts.shape != cu_seqlens.shape:
        raise ValueError(f"v_starts must be int32 like cu_seqlens: {v_starts.dtype} {tuple(v_starts.shape)}")
    if vt8.dtype != FP8 and (vt8.shape != k8.shape or vt8.dtype not in OUT_DTYPES):
        raise ValueError(f"a 16-bit v must be bf16 / fp16 shaped like k: {shapes}, {vt8.dtype}")
    if q8.dtype != FP8 or k8.dtype != FP8:
        raise ValueError(f"q, k must be float8_e4m3fn: {q8.dtype}, {k8.dtype}")
    if not (q8.is_contiguous() and k8.is_contiguous() and vt8.is_contiguous()):
        raise ValueError("q, k, v^T must be contiguous")
    for name, s, n in (("q_scale", q_scale, heads), ("k_scale", k_scale, k8.shape[1]),
                       ("v_scale", v_scale, k8.shape[1])):
        if s.dtype != torch.float32 or tuple(s.shape) != (tokens, n) or not s.is_contiguous():
            raise ValueError(f"{name} must be contiguous fp32 [{tokens}, {n}]: {s.dtype} {tuple(s.shape)}")
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError("cu_seqlens must be a 1-D int32 tensor [num_seqs + 1]")
    if key_perm and vt8.dtype != FP8:
        raise ValueError("key_perm orders V^T's tokens: it needs V in e4m3 (fp8_v)")
    if block_n not in (64, 128) or kv_block % block_n:
        raise ValueError(f"BLOCK_N must be 64 or 128 and divide the K/V scale block {kv_block}: {block_n}")


def fp8_kernel_args(x: Fp8Inputs, out, cu_seqlens, max_seqlen: int, scale: float, causal: bool,
                    config: dict, lengths=None):
    """(positional args, constexpr kwargs, grid) of one launch (also for the sm_90 compile check)."""
    unknown = set(config) - set(DEFAULT_CONFIG)
    if unknown:
        raise ValueError(f"unknown config keys {sorted(unknown)}; known: {sorted(DEFAULT_CONFIG)}")
    cfg = {**DEFAULT_CONFIG, **config}
    if cfg["BLOCK_M"] != 128 or cfg["num_warps"] != 4:
        raise ValueError("the FP8 kernel runs BLOCK_M 128 as two warpgroups of 64 rows (num_warps 4)")
    if (cfg["SNAKE"] and not cfg["PERSISTENT"]) or cfg["HEAD_GROUP"] < 0:
        raise ValueError("SNAKE needs PERSISTENT, HEAD_GROUP >= 0 (gluon_schedule.py)")
    check_fp8_inputs(x, cu_seqlens, cfg["BLOCK_N"])
    q8, k8, vt8, q_scale, k_scale, v_scale, _, v_starts, _, key_perm = x
    tokens, heads, d = q8.shape
    kv_heads = k8.shape[1]
    v_fp8 = vt8.dtype == FP8
    v_desc = _descriptor(vt8, [d, cfg["BLOCK_N"]]) if v_fp8 else \
        _descriptor(vt8.view(tokens, kv_heads * d), [cfg["BLOCK_N"], d])
    items, grid = plan(cfg, lengths, max_seqlen, heads, cu_seqlens, causal,
                       num_sms(q8.device.index or 0) if q8.is_cuda else 132)
    args = (_descriptor(q8.view(tokens, heads * d), [64, d]),
            _descriptor(k8.view(tokens, kv_heads * d), [cfg["BLOCK_N"], d]), v_desc, out, q_scale,
            k_scale, v_scale, cu_seqlens, items, v_starts, max_seqlen, out.stride(0), scale * LOG2E,
            heads // kv_heads, heads, kv_heads, cu_seqlens.numel() - 1)
    return args, dict(HEAD_DIM=d, CAUSAL=causal, V_FP8=v_fp8, KEY_PERM=key_perm, **cfg), grid


def gluon_fp8_prefill_wanted() -> bool:
    """The backend's opt-in (SLIPSTREAM_GLUON_PREFILL=fp8; gluon_prefill_wanted checks the GPU)."""
    return os.environ.get("SLIPSTREAM_GLUON_PREFILL", "0") == "fp8"


def gluon_fp8_prefill(x: Fp8Inputs, cu_seqlens: torch.Tensor, max_seqlen: int, scale: float, *,
                      causal: bool = True, out_dtype: torch.dtype = torch.bfloat16,
                      out: torch.Tensor | None = None, config: dict | None = None,
                      lengths=None) -> torch.Tensor:
    """Self-attention of packed requests from FP8 inputs, on sm_90. x (quantize_fp8_inputs):
    q8 [tokens, heads, D], k8 [tokens, kv_heads, D], v: V^T [kv_heads * D, tokens_pad] e4m3
    (or, QK^T-only FP8, V [tokens, kv_heads, D] bf16 / fp16);
    q_scale [tokens, heads], k_scale / v_scale [tokens, kv_heads] fp32, K's and V's constant
    over each kv_block tokens of a request; cu_seqlens [num_seqs + 1] int32; max_seqlen: host
    int; lengths: the request lengths as host ints (config TABLE needs them).
    Returns out [tokens, heads, D] in out_dtype (bf16 / fp16)."""
    q8 = x.q8
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    if not q8.is_cuda or not _is_sm90(q8.device.index or 0):
        raise ValueError("the Gluon FP8 prefill kernel needs an sm_90 (Hopper) GPU")
    if out is None:
        out = torch.empty(q8.shape, dtype=out_dtype, device=q8.device)
    elif out.shape != q8.shape or out.dtype not in OUT_DTYPES or not out.is_contiguous():
        raise ValueError("out must be contiguous bf16 / fp16 shaped like q")
    if max_seqlen <= 0 or q8.shape[0] == 0:
        return out
    if config is None:
        config = {"PERSISTENT": max_seqlen <= PERSISTENT_UP_TO, "SNAKE": max_seqlen <= PERSISTENT_UP_TO}
    args, consts, grid = fp8_kernel_args(x, out, cu_seqlens, max_seqlen, scale, causal, config, lengths)
    if grid[0]:
        _fp8_prefill_kernel[grid](*args, **consts)
    return out

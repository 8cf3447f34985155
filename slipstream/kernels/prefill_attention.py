"""Prefill attention: FlashAttention-2 over a variable-length batch with a paged KV cache.

One program owns BLOCK_M query tokens of one head of one request and streams
that request's keys past them in BLOCK_N tiles (chapter 2.2, 2.5): Q stays on
chip, the softmax is online, the division by the running sum waits until the
end, and the grid spans (query block, head, request) so long prompts fill the
GPU even at batch size 1.

A request's keys come in two parts, each in order:
  * its cached context [0, context_len): read from the paged cache through the
    block table (prefix-cache hits, earlier chunks of a chunked prefill), by
    the fetch mode `paged_load` picks (prefill_paged.py: gathers whose
    block-table entries are read a tile ahead, or TMA tiles for large pages);
  * the step's own tokens: read from the fresh `k`/`v` rows, contiguous, so on
    Hopper they stream through the bulk tensor copy engine (TMA descriptors).
    With `k=None` they are read from the cache too (they must be stored first).
Each part runs an unmasked loop over the tiles every row may see in full, then
a masked loop over the few tiles on the causal diagonal, the sequence end or the
sliding-window edge. Query blocks run latest-first, so the longest causal rows
start first and the tail of the grid is short.

GQA/MQA: query head h reads KV head h // group; K/V are never repeated in memory
(heads of one group run in neighbouring programs and share the tiles in L2).

FP8 (in the spirit of FlashAttention-3): with `q_scale`/`k_scale` given, q and k
are float8 e4m3 with one scale per token and head (see fp8_attention.py) and
QK^T runs on the FP8 tensor cores; P.V stays in v's dtype.

Quantized KV cache (CACHE_QUANT: int8 / fp8 codes with one fp32 scale per token
and head): the cached context is read as codes and dequantized in registers
(attention_tile.py); the step's own keys come from the fresh `k`/`v` at full
precision, as they would before being stored.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from triton.tools.tensor_descriptor import TensorDescriptor

from slipstream.kernels.attention_tile import (
    LOG2E, attend_paged_range, check_kv_scales, exact_dot, next_pow2, softmax_tile_update)
from slipstream.kernels.prefill_configs import (
    INTERPRET_CONFIG, UNTUNED_CONFIG, PREFILL_CONFIGS, paged_load_args, prune_configs, set_block_shapes)
from slipstream.kernels.prefill_paged import attend_cached, tile_pages
from slipstream.kernels.runtime import capability, interpreting



@triton.jit
def _new_keys(acc, m_i, l_i, q, q_row_scale, K, V, KScale, k_row0, kv_head,
              lo, hi, q_len, q_idx, window, qk_scale,
              stride_kt, stride_vt, stride_kst,
              HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
              CAUSAL: tl.constexpr, SLIDING: tl.constexpr, MASKED: tl.constexpr,
              USE_TMA: tl.constexpr, FP8: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    """Attend to the step's own keys [lo, hi) (local indices; lo a multiple of
    BLOCK_N). With USE_TMA, K/V are host-built TMA descriptors over [tokens,
    kv_heads * head_dim]; else pointers at this request's first row and KV head."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    for start in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        start = tl.multiple_of(start, BLOCK_N)
        j = start + offs_n
        key_ok = j < q_len
        if USE_TMA:
            # Rows past this request belong to the next one (or are zero-filled
            # past the tensor): finite, and masked below.
            k = K.load([k_row0 + start, kv_head * HEAD_DIM]).T
            v = V.load([k_row0 + start, kv_head * HEAD_DIM])
        elif MASKED or HEAD_DIM_PAD != HEAD_DIM:
            d_ok = offs_d < HEAD_DIM
            k = tl.load(K + j[None, :] * stride_kt + offs_d[:, None],
                        mask=key_ok[None, :] & d_ok[:, None], other=0.0)
            v = tl.load(V + j[:, None] * stride_vt + offs_d[None, :],
                        mask=key_ok[:, None] & d_ok[None, :], other=0.0)
        else:
            k = tl.load(K + j[None, :] * stride_kt + offs_d[:, None])
            v = tl.load(V + j[:, None] * stride_vt + offs_d[None, :])
        qk = exact_dot(q, k)
        if FP8:
            k_scale = tl.load(KScale + (k_row0 + j) * stride_kst + kv_head, mask=key_ok, other=0.0)
            qk = qk * q_row_scale[:, None] * k_scale[None, :]
        mask = key_ok[None, :]
        if CAUSAL:
            mask = mask & (j[None, :] <= q_idx[:, None])
        if SLIDING:
            mask = mask & (q_idx[:, None] - j[None, :] < window)
        acc, m_i, l_i = softmax_tile_update(acc, m_i, l_i, qk, v, qk_scale, mask, MASKED)
    return acc, m_i, l_i


# Scalars that change every step are not specialised on (==1, divisible by 16):
# each new specialisation is a compile in the middle of serving.
@triton.jit(do_not_specialize=["max_query_len", "qk_scale", "window", "tune_key"])
def _prefill_kernel(
        Q, K, V, KCache, VCache, KCacheScale, VCacheScale, KCacheDesc, VCacheDesc, Out, OutDesc,
        QScale, KScale, CuSeqlensQ, ContextLens, BlockTables,
        max_query_len,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
        stride_cb, stride_cs, stride_ch, stride_csb, stride_css, stride_bt, stride_qst, stride_kst,
        qk_scale, window, tune_key,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
        CAUSAL: tl.constexpr, SLIDING: tl.constexpr, NEW_KV: tl.constexpr,
        USE_TMA: tl.constexpr, FP8: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
        TMA_STORE: tl.constexpr, PAIRED: tl.constexpr, CACHE_QUANT: tl.constexpr,
        PAGED_LOAD: tl.constexpr, OFFS32: tl.constexpr):
    # Latest (longest causal) query blocks first. Query blocks are the fastest
    # grid axis, so programs running together share one head's K/V in L2.
    # (Measured on an H200, benchmarks/attention: ordering by query block
    # across all heads and requests balances the causal tail but thrashes L2,
    # 4k non-causal -13%; chunks of a few (request, head) pairs gained nothing.)
    # PAIRED (causal): program p owns query blocks last - p and p, so every
    # program does the same work (a long block, then a short one) and no long
    # block is left to start near the end of the grid.
    head = tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(CuSeqlensQ + seq)
    q_len = tl.load(CuSeqlensQ + seq + 1) - q_start
    ctx = tl.load(ContextLens + seq)
    last = tl.cdiv(max_query_len, BLOCK_M) - 1
    pid = tl.program_id(0)
    for i in tl.static_range(1 + PAIRED):
        m_block = last - pid if i == 0 else pid
        todo = m_block * BLOCK_M < q_len
        if i == 1:
            todo = todo & (pid < last - pid)  # the middle block of an odd count runs once
        if todo:
            _query_block(Q, K, V, KCache, VCache, KCacheScale, VCacheScale, KCacheDesc, VCacheDesc,
                         Out, OutDesc, QScale, KScale, BlockTables, m_block, head, seq, q_start, q_len, ctx,
                         stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                         stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_csb,
                         stride_css, stride_bt, stride_qst, stride_kst, qk_scale, window,
                         GROUP, HEAD_DIM, HEAD_DIM_PAD, BLOCK_M, BLOCK_N, PAGE_SIZE, CAUSAL,
                         SLIDING, NEW_KV, USE_TMA, FP8, WARP_SPECIALIZE, TMA_STORE, CACHE_QUANT,
                         PAGED_LOAD, OFFS32)


@triton.jit
def _query_block(Q, K, V, KCache, VCache, KCacheScale, VCacheScale, KCacheDesc, VCacheDesc,
                 Out, OutDesc, QScale, KScale, BlockTables, m_block, head, seq, q_start, q_len, ctx,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                 stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_csb, stride_css,
                 stride_bt, stride_qst, stride_kst, qk_scale, window,
                 GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
                 CAUSAL: tl.constexpr, SLIDING: tl.constexpr, NEW_KV: tl.constexpr,
                 USE_TMA: tl.constexpr, FP8: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
                 TMA_STORE: tl.constexpr, CACHE_QUANT: tl.constexpr, PAGED_LOAD: tl.constexpr,
                 OFFS32: tl.constexpr):
    """BLOCK_M query rows (block m_block of the request's step) of one head:
    attend to the cached context, then to the step's own keys, and store."""
    kv_head = head // GROUP
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # query index within the step
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    row_ok = offs_m < q_len
    d_ok = offs_d < HEAD_DIM
    q_rows = q_start.to(tl.int64) + offs_m

    if USE_TMA:  # Q is a descriptor over [tokens, heads * head_dim]
        q = Q.load([q_start + m_block * BLOCK_M, head * HEAD_DIM])
    else:
        q = tl.load(Q + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q_row_scale = qk_scale  # FP8: per-row dequantisation scale, folded in below
    if FP8:
        q_row_scale = tl.load(QScale + q_rows * stride_qst + head, mask=row_ok, other=0.0) * qk_scale

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)

    # --- cached context (and, without NEW_KV, the step's keys too) ---
    paged_end = ctx
    if not NEW_KV:
        paged_end = ctx + q_len
    lo = 0
    if SLIDING:  # keys before the first row's window are never seen
        lo = tl.maximum(ctx + m_block * BLOCK_M - window + 1, 0) // BLOCK_N * BLOCK_N
    if CAUSAL and not NEW_KV:
        hi = tl.minimum(paged_end, ctx + (m_block + 1) * BLOCK_M)
        free_end = (ctx + m_block * BLOCK_M) // BLOCK_N * BLOCK_N
    else:
        hi = paged_end
        free_end = paged_end // BLOCK_N * BLOCK_N
    if SLIDING:
        free_end = lo
    bt_row = BlockTables + seq.to(tl.int64) * stride_bt
    q_pos = ctx + offs_m
    if PAGED_LOAD == 3:  # the loop shared with the decode kernel (q_pos: unused tree bits)
        acc, m_i, l_i = attend_paged_range(
            acc, m_i, l_i, q, KCache, VCache, KCacheScale, VCacheScale, bt_row, kv_head, lo,
            free_end, hi, paged_end, q_pos, window, qk_scale, stride_cb, stride_cs, stride_ch,
            stride_csb, stride_css, q_pos, ctx, HEAD_DIM, HEAD_DIM_PAD, BLOCK_N, PAGE_SIZE, CAUSAL,
            SLIDING, False, CACHE_QUANT)
    elif PAGED_LOAD % 8 >= 4:  # one pipeline over clean and edge tiles
        acc, m_i, l_i = attend_cached(
            acc, m_i, l_i, q, KCache, VCache, KCacheScale, VCacheScale, KCacheDesc, VCacheDesc,
            bt_row, tile_pages(bt_row, lo, paged_end, BLOCK_N, PAGE_SIZE), kv_head, lo, free_end,
            hi, paged_end, q_pos, window, qk_scale, stride_cb, stride_cs, stride_ch, stride_csb,
            stride_css, HEAD_DIM, HEAD_DIM_PAD, BLOCK_N, PAGE_SIZE, CAUSAL, SLIDING, True,
            CACHE_QUANT, PAGED_LOAD % 4, OFFS32, True, PAGED_LOAD >= 8)
    else:
        # Both loops' first block-table entries now, so neither loop's start waits on them.
        pages_lo = tile_pages(bt_row, lo, paged_end, BLOCK_N, PAGE_SIZE)
        pages_edge = tile_pages(bt_row, free_end, paged_end, BLOCK_N, PAGE_SIZE)
        acc, m_i, l_i = attend_cached(
            acc, m_i, l_i, q, KCache, VCache, KCacheScale, VCacheScale, KCacheDesc, VCacheDesc,
            bt_row, pages_lo, kv_head, lo, free_end, free_end, paged_end, q_pos, window, qk_scale,
            stride_cb, stride_cs, stride_ch, stride_csb, stride_css, HEAD_DIM, HEAD_DIM_PAD,
            BLOCK_N, PAGE_SIZE, CAUSAL, SLIDING, False, CACHE_QUANT, PAGED_LOAD % 4, OFFS32, False,
            PAGED_LOAD >= 8)
        acc, m_i, l_i = attend_cached(
            acc, m_i, l_i, q, KCache, VCache, KCacheScale, VCacheScale, KCacheDesc, VCacheDesc,
            bt_row, pages_edge, kv_head, free_end, free_end, hi, paged_end, q_pos, window,
            qk_scale, stride_cb, stride_cs, stride_ch, stride_csb, stride_css, HEAD_DIM,
            HEAD_DIM_PAD, BLOCK_N, PAGE_SIZE, CAUSAL, SLIDING, True, CACHE_QUANT, PAGED_LOAD % 4,
            OFFS32, False, PAGED_LOAD >= 8)

    # --- the step's own keys, contiguous in k/v ---
    if NEW_KV:
        if CAUSAL:
            hi_n = tl.minimum(q_len, (m_block + 1) * BLOCK_M)
            free_n = m_block * BLOCK_M  # BLOCK_M % BLOCK_N == 0
        else:
            hi_n = q_len
            free_n = q_len // BLOCK_N * BLOCK_N
        lo_n = 0
        if SLIDING:
            lo_n = tl.maximum(m_block * BLOCK_M - window + 1, 0) // BLOCK_N * BLOCK_N
            free_n = lo_n
        if USE_TMA:
            k_src = K
            v_src = V
        else:
            k_src = K + q_start.to(tl.int64) * stride_kt + kv_head * stride_kh
            v_src = V + q_start.to(tl.int64) * stride_vt + kv_head * stride_vh
        scale = qk_scale
        if FP8:
            scale = 1.0  # already in q_row_scale
        acc, m_i, l_i = _new_keys(acc, m_i, l_i, q, q_row_scale, k_src, v_src, KScale, q_start,
                                  kv_head, lo_n, free_n, q_len, offs_m, window, scale,
                                  stride_kt, stride_vt, stride_kst, HEAD_DIM, HEAD_DIM_PAD,
                                  BLOCK_N, CAUSAL, SLIDING, False, USE_TMA, FP8, WARP_SPECIALIZE)
        acc, m_i, l_i = _new_keys(acc, m_i, l_i, q, q_row_scale, k_src, v_src, KScale, q_start,
                                  kv_head, free_n, hi_n, q_len, offs_m, window, scale,
                                  stride_kt, stride_vt, stride_kst, HEAD_DIM, HEAD_DIM_PAD,
                                  BLOCK_N, CAUSAL, SLIDING, True, USE_TMA, FP8, False)

    out = acc / l_i[:, None]
    if TMA_STORE and (m_block + 1) * BLOCK_M <= q_len:  # a full block: one bulk async store
        OutDesc.store([q_start + m_block * BLOCK_M, head * HEAD_DIM], out.to(OutDesc.dtype))
    else:
        tl.store(Out + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
                 out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


# (Not keyed on OFFS32: the start-up tuning runs on a small scratch pool, and a
# pool past 2**31 elements must not re-tune in a serving step; it only compiles.)
_prefill_tuned = triton.autotune(PREFILL_CONFIGS, key=["tune_key", "HEAD_DIM", "CAUSAL", "NEW_KV",
                                                       "SLIDING", "FP8", "USE_TMA", "CACHE_QUANT",
                                                       "PAGE_SIZE", "PAGED_LOAD"],
                                 prune_configs_by={"early_config_prune": prune_configs})(_prefill_kernel)


# --- launcher -------------------------------------------------------------------

def prefill_attention(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                      k_cache: torch.Tensor, v_cache: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                      block_tables: torch.Tensor, max_query_len: int, scale: float, *,
                      causal: bool = True, sliding_window: int | None = None,
                      q_scale: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                      out: torch.Tensor | None = None, config: dict | None = None,
                      use_tma: bool | None = None, k_cache_scale: torch.Tensor | None = None,
                      v_cache_scale: torch.Tensor | None = None,
                      paged_load: str | None = None) -> torch.Tensor:
    """Variable-length attention of the step's tokens to their requests' keys.

    q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
    (the step's own K/V) or None to read them from the cache (already stored).
    k_cache, v_cache: [num_blocks, page_size, num_kv_heads, head_dim].
    cu_seqlens_q: [num_seqs + 1] int32; context_lens: [num_seqs] int32 (cached
    tokens before the step's); block_tables: [num_seqs, max_blocks] int32.
    max_query_len: host int, sizes the grid. q_scale/k_scale: [num_tokens, heads]
    fp32 when q/k are float8 (FP8 path). config: fixed tile config (benchmarks).
    k_cache_scale, v_cache_scale: [num_blocks, page_size, num_kv_heads] fp32 when
    the cache holds int8 / fp8 codes, else None. paged_load: how cached K/V
    tiles are fetched (a key of prefill_configs.PAGED_LOADS; None: its default).
    returns out: [num_tokens, num_heads, head_dim] in v's dtype.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    page_size = k_cache.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if sliding_window is not None and not causal:
        raise ValueError("sliding_window needs causal attention")
    fp8 = q_scale is not None
    if fp8 and (k is None or k_scale is None):
        raise ValueError("the FP8 path needs k, v and both scales")
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and k_cache.stride() == v_cache.stride()
    assert page_size & (page_size - 1) == 0, "page size must be a power of two"
    cache_quant = check_kv_scales(k_cache, v_cache, k_cache_scale, v_cache_scale)
    if out is None:
        out = torch.empty(q.shape, dtype=(v if v is not None else q).dtype, device=q.device)
    new_kv = k is not None
    head_dim_pad = next_pow2(head_dim)
    if use_tma is None:
        use_tma = q.is_cuda and capability(q.device.index or 0)[0] >= 9
    load, offs32, cache_descs = paged_load_args(paged_load, k_cache, v_cache, k_cache_scale, page_size,
                                            head_dim_pad == head_dim and use_tma and not cache_quant)
    # Q (and the output) go by TMA even when every key comes from the cache.
    use_tma = bool(use_tma and head_dim_pad == head_dim and q.stride(1) == head_dim and (
        not new_kv or (k.stride(1) == head_dim and v.stride(1) == head_dim and k.stride(2) == 1)))
    if not new_kv:
        k = v = q  # unused placeholders (each its own descriptor with TMA)
    q_arg, k_arg, v_arg = q, k, v
    if use_tma:  # 2-D views [tokens, heads * head_dim]; tile shapes set per config
        q_arg, k_arg, v_arg = (TensorDescriptor(x, [num_tokens, x.shape[1] * head_dim],
                                                [x.stride(0), 1], [1, head_dim]) for x in (q, k, v))
    out_desc = out
    if use_tma and out.stride(1) == head_dim and out.stride(2) == 1:
        out_desc = TensorDescriptor(out, [num_tokens, num_heads * head_dim], [out.stride(0), 1],
                                    [1, head_dim])
    cache_scales = (k_cache_scale, v_cache_scale) if cache_quant else (k_cache, v_cache)
    args = (q_arg, k_arg, v_arg, k_cache, v_cache, *cache_scales, *cache_descs, out, out_desc,
            q_scale if fp8 else q, k_scale if fp8 else q,
            cu_seqlens_q, context_lens, block_tables)
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
               out.stride(0), out.stride(1),
               k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
               *(k_cache_scale.stride()[:2] if cache_quant else (0, 0)), block_tables.stride(0),
               q_scale.stride(0) if fp8 else 0, k_scale.stride(0) if fp8 else 0)
    window = sliding_window if sliding_window is not None else 0
    tune_key = max(int(max_query_len) - 1, 0).bit_length()
    consts = dict(GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
                  PAGE_SIZE=page_size, CAUSAL=causal, SLIDING=sliding_window is not None,
                  NEW_KV=new_kv, USE_TMA=use_tma, FP8=fp8, CACHE_QUANT=cache_quant,
                  PAGED_LOAD=load, OFFS32=offs32)
    num_seqs = cu_seqlens_q.shape[0] - 1

    def grid(meta):
        blocks = triton.cdiv(max_query_len, meta["BLOCK_M"])
        return (triton.cdiv(blocks, 2) if meta["PAIRED"] else blocks, num_heads, num_seqs)

    if config is None and interpreting():
        config = INTERPRET_CONFIG
    elif config is None and os.environ.get("SLIPSTREAM_ATTENTION_TUNE", "1") in ("", "0"):
        config = UNTUNED_CONFIG   # no start-up tuning (quick starts: tests, small models)
    if config is None:
        _prefill_tuned[grid](*args, max_query_len, *strides, scale * LOG2E, window, tune_key, **consts)
    else:
        meta = {"WARP_SPECIALIZE": False, "TMA_STORE": False, "PAIRED": False, **config}
        if meta["BLOCK_M"] % meta["BLOCK_N"]:
            raise ValueError(f"BLOCK_M {meta['BLOCK_M']} must be a multiple of BLOCK_N {meta['BLOCK_N']}")
        meta["TMA_STORE"] = meta["TMA_STORE"] and out_desc is not out
        launch = {k_: meta.pop(k_) for k_ in ("num_warps", "num_stages", "maxnreg") if k_ in meta}
        set_block_shapes({"Q": q_arg, "K": k_arg, "V": v_arg, "OutDesc": out_desc,
                           "KCacheDesc": cache_descs[0], "VCacheDesc": cache_descs[1],
                           "HEAD_DIM": head_dim, **meta})
        _prefill_kernel[grid(meta)](*args, max_query_len, *strides, scale * LOG2E, window,
                                    tune_key, **consts, **meta, **launch)
    return out

"""Decode attention: FlashDecoding over the paged KV cache (chapter 2.7).

A decode step has one query token per request, so a FlashAttention grid over
(query block, head, request) leaves most SMs idle. Here the KV sequence is also
split: program (request, KV head, split) streams its share of the request's
pages and writes a partial output with its log-sum-exp; a second small kernel
merges the splits with the online-softmax rule
    out = sum_s exp2(lse_s - max) * o_s / sum_s exp2(lse_s - max).

GQA: the query tile holds all query heads of one KV group (rows = query token x
head in group), so each K/V tile is loaded once for the whole group; the tile
is at least 16 rows for the tensor cores, padding small groups.

The same kernel serves tree verification (tree_attention.py): rows then span
several query tokens of a request and a per-token bitmask (int64, so trees of
at most 64 nodes) says which of the step's tokens each may see.

A quantized cache (int8 / fp8 codes, one fp32 scale per token and head) is
read as codes and dequantized in registers: half the bytes of a 16-bit cache,
plus 4 bytes of scales per 128-dim token head. Codes converted to the query's
dtype (attention_tile.py) cost the loop more instructions than the bytes save;
config KV_DOT picks the paths with fewer (code_tile.py, decode_configs.py).

The grid depends only on the batch size, the head counts and the split count,
so a decode step can be captured in a CUDA graph. Unsplit decode steps whose
contexts are at most SHORT_MAX_LEN keys go to short_decode_attention.py
instead (one program per request and KV head, the first tile's reads before
the wait on the kernel before), which `split_kv_attention` dispatches to.

On Hopper the kernels are chained by programmatic dependent launch: the split
kernel may start while the kernel before it (the KV store, or the previous
call's merge) is still running, reads its sequence lengths, and waits for that
kernel only before it reads the query and the cache; the merge kernel starts
while the splits drain and waits for them before reading their partials. Only
our KV-store and merge kernels signal early launch, and neither writes the
sequence metadata, so the reads before the wait are safe.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from slipstream.kernels.attention_tile import (
    LOG2E, attend_paged_range, check_kv_scales, next_pow2, prefetch_paged_keys)
from slipstream.kernels.code_tile import attend_code_range, fp16_query, int8_query
from slipstream.kernels.decode_configs import (  # noqa: F401 (re-exported)
    DEEP_CONFIG, DEEP_PER_SM, DEFAULT_KV_DOT, DEFAULT_PREFETCH, MAX_SPLITS, MAX_TREE_NODES,
    MIN_TOKENS_PER_SPLIT, QUANT_DEEP_CONFIG, QUANT_WIDE_CONFIG, SHORT_MAX_LEN, TALL_CONFIG,
    TALL_PER_SM, UNSPLIT_MAX_LEN, WIDE_CONFIG, _launch_config, _tile_rows, choose_num_splits, default_kv_dot)
from slipstream.kernels.runtime import interpreting, pdl_supported
from slipstream.kernels.short_decode_attention import short_decode_attention, short_decode_default
from slipstream.kernels.split_merge import merge_splits, split_kv_scratch  # noqa: F401 (re-exported)



@triton.jit(do_not_specialize=["num_kv_heads", "num_splits", "qk_scale", "window"])
def _split_kv_kernel(
        Q, KCache, VCache, KScale, VScale, Out, PartO, PartLse,
        CuSeqlensQ, SeqLens, BlockTables, TreeBits,
        num_kv_heads, num_splits,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_cb, stride_cs, stride_ch, stride_sb, stride_ss, stride_bt,
        stride_pt, stride_ph, stride_ps, stride_lt, stride_lh,
        stride_tb,
        qk_scale, window,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
        SPLIT: tl.constexpr, SLIDING: tl.constexpr, TREE: tl.constexpr, PDL: tl.constexpr,
        CHAIN: tl.constexpr, QUANT: tl.constexpr, KV_DOT: tl.constexpr,
        ASM: tl.constexpr, PREFETCH: tl.constexpr):
    if PDL:  # let the merge kernel launch now; it waits for this grid before reading
        gdc_launch_dependents()
    seq = tl.program_id(0)
    kv_head = tl.program_id(1) % num_kv_heads
    m_block = tl.program_id(1) // num_kv_heads
    split = tl.program_id(2)
    q_start = tl.load(CuSeqlensQ + seq)
    q_len = tl.load(CuSeqlensQ + seq + 1) - q_start
    if m_block * BLOCK_M >= q_len * GROUP:
        return
    seq_len = tl.load(SeqLens + seq)
    ctx = seq_len - q_len

    # Keys this row block can see: up to its last token; from its first token's window.
    t_first = m_block * BLOCK_M // GROUP
    t_last = tl.minimum(q_len - 1, ((m_block + 1) * BLOCK_M - 1) // GROUP)
    hi = ctx + t_last + 1
    lo = 0
    if SLIDING:
        lo = tl.maximum(ctx + t_first - window + 1, 0)
    # This split's share of those tiles.
    first_tile = lo // BLOCK_N
    num_tiles = tl.cdiv(hi, BLOCK_N) - first_tile
    per_split = tl.cdiv(num_tiles, num_splits)
    start_tile = first_tile + split * per_split
    end_tile = tl.minimum(start_tile + per_split, first_tile + num_tiles)
    bt_row = BlockTables + seq.to(tl.int64) * stride_bt
    if PREFETCH > 0:  # the split's first PREFETCH keys into L2 while the kernel before ends
        prefetch_paged_keys(KCache, VCache, KScale, VScale, bt_row, start_tile * BLOCK_N,
                            end_tile * BLOCK_N, kv_head, stride_cb, stride_cs, stride_ch,
                            stride_sb, stride_ss, HEAD_DIM, PREFETCH, PAGE_SIZE, QUANT)
    if CHAIN:  # launched early: the query and the cache may still be being written
        gdc_wait()

    # Row r of the tile is query token r // GROUP, head kv_head * GROUP + r % GROUP.
    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    t = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = t < q_len
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    tok = q_start.to(tl.int64) + t
    q = tl.load(Q + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q_pos = ctx + t

    tree_bits = t.to(tl.int64)  # (stands in when not TREE)
    if TREE:  # row r's bitmask of the step's tokens it may see
        tree_bits = tl.load(TreeBits + seq.to(tl.int64) * stride_tb + t, mask=row_ok, other=0)
    # Tiles wholly before the step's first token (and, without a window, seen
    # by every row) run unmasked; the rest (the sequence end, the step's own
    # tokens, the window edge) masked.
    lo_pos = start_tile * BLOCK_N
    hi_pos = end_tile * BLOCK_N
    clean = tl.maximum(tl.minimum(hi_pos, ctx // BLOCK_N * BLOCK_N), lo_pos)
    if SLIDING:
        clean = lo_pos
    if KV_DOT > 0:  # code_tile.py: 1 fp16 operands, 2 and V as 16-bit words, 3 and int8 K.q
        if KV_DOT == 3 and KCache.dtype.element_ty == tl.int8:
            q16, q_lo, q_unscale = int8_query(q)
        else:
            q16, q_unscale = fp16_query(q)
            q_lo = q16
        acc, m_i, l_i = attend_code_range(
            q16, q_lo, q_unscale, KCache, VCache, KScale, VScale, bt_row, kv_head, lo_pos, clean, hi_pos,
            hi, q_pos, window, qk_scale, stride_cb, stride_cs, stride_ch, stride_sb, stride_ss,
            tree_bits, ctx, BLOCK_M, HEAD_DIM, BLOCK_N, PAGE_SIZE, True, SLIDING, TREE, KV_DOT >= 2,
            ASM, KV_DOT == 3 and KCache.dtype.element_ty == tl.int8)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
        acc, m_i, l_i = attend_paged_range(
            acc, m_i, l_i, q, KCache, VCache, KScale, VScale, bt_row, kv_head, lo_pos, clean, hi_pos,
            hi, q_pos, window, qk_scale, stride_cb, stride_cs, stride_ch, stride_sb, stride_ss,
            tree_bits, ctx, HEAD_DIM, HEAD_DIM_PAD, BLOCK_N, PAGE_SIZE, True, SLIDING, TREE, QUANT)

    if not SPLIT:
        out = acc / l_i[:, None]
        tl.store(Out + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        # An empty split (short request) leaves l = 0: weight 0 in the merge.
        seen = l_i > 0
        l_safe = tl.where(seen, l_i, 1.0)
        lse = tl.where(seen, m_i + tl.math.log2(l_safe), float("-inf"))
        tl.store(PartO + tok[:, None] * stride_pt + head[:, None] * stride_ph + split * stride_ps
                 + offs_d[None, :], acc / l_safe[:, None], mask=row_ok[:, None] & d_ok[None, :])
        tl.store(PartLse + tok * stride_lt + head * stride_lh + split, lse, mask=row_ok)


# --- launcher -------------------------------------------------------------------

def split_kv_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                       block_tables: torch.Tensor, max_query_len: int, scale: float,
                       num_splits: int, sliding_window: int | None = None,
                       tree_bits: torch.Tensor | None = None, out: torch.Tensor | None = None,
                       scratch: tuple[torch.Tensor, torch.Tensor] | None = None,
                       config: dict | None = None, k_scale: torch.Tensor | None = None,
                       v_scale: torch.Tensor | None = None,
                       max_seq_len: int | None = None) -> torch.Tensor:
    """Few query tokens per request against the paged cache, split over the KV
    sequence. Shared by decode (one token) and tree verification (a masked tree).

    q: [num_tokens, num_heads, head_dim]; its tokens' K/V already in the cache.
    cu_seqlens_q: [num_seqs + 1] int32; seq_lens: [num_seqs] int32 (context +
    query tokens). tree_bits: [num_seqs, >=max_query_len] int64 from
    `pack_tree_mask` (bit j of row t: token t may see the step's token j), else
    causal. scratch: (partial out [num_tokens, num_heads, num_splits, head_dim]
    fp32, lse [num_tokens, num_heads, num_splits] fp32). config: overrides of
    the launch config (BLOCK_N, num_warps, num_stages, CHAIN, KV_DOT), for benchmarks.
    k_scale, v_scale: [num_blocks, page_size, num_kv_heads] fp32 when the cache
    holds int8 / fp8 codes (kernels/kv_store.py writes them), else None.
    max_seq_len: a bound on seq_lens (host int; for a captured graph, the bound of
    its context class). Decode steps (one token a request, no window) with
    max_seq_len <= SHORT_MAX_LEN (unsplit: choose_num_splits gives 1 there) run
    the short-context kernel where it was measured faster (`short_decode_default`:
    16-bit caches, at most one program an SM); config SHORT=True / False forces
    it on / off.
    returns out: [num_tokens, num_heads, head_dim] in q's dtype.
    """
    config = dict(config or {})
    short = config.pop("SHORT", None)
    if short is None:
        # Not when the caller tunes the split kernel (other config keys), nor for
        # fp16 queries over an int8 / fp8 cache: the short kernel multiplies P by
        # V's scales in the query's dtype, where small scales sink into fp16's
        # subnormals (the split kernel's code paths rescale; bf16 has the range).
        short = (max_seq_len is not None and max_seq_len <= SHORT_MAX_LEN and not config
                 and not (k_scale is not None and q.dtype == torch.float16))
        short = short and short_decode_default(q.shape[0] * k_cache.shape[2], k_scale is not None,
                                               q.device)
    if (short and max_query_len == 1 and tree_bits is None and sliding_window is None
            and q.shape[0] == cu_seqlens_q.shape[0] - 1):  # (num_splits then unused)
        return short_decode_attention(q, k_cache, v_cache, seq_lens, block_tables, scale,
                                      out=out, k_scale=k_scale, v_scale=v_scale)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, page_size = k_cache.shape[2], k_cache.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and k_cache.stride() == v_cache.stride()
    assert page_size & (page_size - 1) == 0, "page size must be a power of two"
    quant = check_kv_scales(k_cache, v_cache, k_scale, v_scale)
    if out is None:
        out = torch.empty_like(q)
    group = num_heads // num_kv_heads
    head_dim_pad = next_pow2(head_dim)
    num_seqs = cu_seqlens_q.shape[0] - 1
    block_m, row_blocks = _tile_rows(max_query_len, group, num_seqs, num_kv_heads)
    cfg = {**_launch_config(block_m, num_seqs * num_kv_heads * row_blocks * num_splits, q.device,
                            quant, tree_bits is not None, num_splits), **config}
    block_n = cfg.pop("BLOCK_N")
    kv_dot = cfg.pop("KV_DOT", default_kv_dot(k_cache.dtype, block_m))
    if kv_dot not in (0, 1, 2, 3):
        raise ValueError(f"KV_DOT must be 0, 1, 2 or 3, got {kv_dot}")
    if not quant or q.dtype == torch.float32 or head_dim != head_dim_pad:
        kv_dot = 0   # fp32 engines keep fp32 operands; padded head dims take the general path
    # Inline PTX code conversions (not run by the interpreter: Triton ops there).
    asm = cfg.pop("ASM", True) and not interpreting()
    prefetch = cfg.pop("PREFETCH", DEFAULT_PREFETCH)
    pdl_ok = pdl_supported(q)
    chain = cfg.pop("CHAIN", True) and pdl_ok
    if not chain or interpreting():
        prefetch = 0
    pdl = num_splits > 1 and pdl_ok
    if num_splits > 1:
        if scratch is None:
            scratch = split_kv_scratch(num_tokens, num_heads, num_splits, head_dim, q.device)
        part_o, part_lse = scratch
    else:
        part_o, part_lse = out, out  # unused
    if tree_bits is not None:
        assert tree_bits.dtype == torch.int64 and tree_bits.stride(1) == 1
        assert tree_bits.shape[1] >= max_query_len and max_query_len <= MAX_TREE_NODES
        tree = (tree_bits, tree_bits.stride(0))
    else:
        tree = (q, 0)
    po_strides = part_o.stride()[:3] if num_splits > 1 else (0, 0, 0)
    pl_strides = part_lse.stride()[:2] if num_splits > 1 else (0, 0)
    _split_kv_kernel[(num_seqs, num_kv_heads * row_blocks, num_splits)](
        q, k_cache, v_cache, *(k_scale, v_scale) if quant else (k_cache, v_cache), out, part_o,
        part_lse, cu_seqlens_q, seq_lens, block_tables, tree[0], num_kv_heads, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        *(k_scale.stride()[:2] if quant else (0, 0)), block_tables.stride(0),
        *po_strides, *pl_strides, tree[1],
        scale * LOG2E, sliding_window or 0,
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_M=block_m,
        BLOCK_N=block_n, PAGE_SIZE=page_size, SPLIT=num_splits > 1,
        SLIDING=sliding_window is not None, TREE=tree_bits is not None, PDL=pdl, CHAIN=chain,
        QUANT=quant, KV_DOT=kv_dot, ASM=asm, PREFETCH=prefetch, launch_pdl=chain, **cfg)
    if num_splits > 1:
        merge_splits(part_o, part_lse, out, num_splits, head_dim, head_dim_pad, pdl)
    return out


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float, *,
                     max_seq_len: int, sliding_window: int | None = None,
                     num_splits: int | None = None, cu_seqlens_q: torch.Tensor | None = None,
                     out: torch.Tensor | None = None,
                     scratch: tuple[torch.Tensor, torch.Tensor] | None = None,
                     config: dict | None = None, k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per request, attending to its paged context (itself included).

    q: [num_seqs, num_heads, head_dim]; seq_lens: [num_seqs] int32; block_tables:
    [num_seqs, max_blocks] int32; max_seq_len: host int (sizes the splits).
    returns [num_seqs, num_heads, head_dim].
    """
    num_seqs = q.shape[0]
    if cu_seqlens_q is None:
        cu_seqlens_q = torch.arange(num_seqs + 1, dtype=torch.int32, device=q.device)
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, k_cache.shape[2], max_seq_len,
                                       group=q.shape[1] // k_cache.shape[2])
    return split_kv_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, 1, scale,
                              num_splits, sliding_window, None, out, scratch, config,
                              k_scale, v_scale, max_seq_len)

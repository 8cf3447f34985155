"""Decode attention for short contexts: one program per (request, KV head).

The split-KV kernel (decode_attention.py) is built to stream long contexts;
for a context of a few hundred keys at small batch its time is its latency
chain, not its bytes (H200, Llama-3-8B shape, B=1, 130 keys: 9.2 us for 0.5 MB).
Counted in its sm_90 code: the request's query offsets, then its sequence
length, then (pages of 16 keys under 64-key tiles) one block-table read a key,
then the K/V rows, all in series, and again for the masked last tile in a
second software-pipelined loop with its own prologue.

Here the first tile is peeled off the loop and its block-table entries are read
at once, before the sequence length is known (entries past the end of the
request are read but never followed: the K/V reads are masked by the length);
with programmatic dependent launch that read overlaps the kernel before (the
KV store). After the wait one round trip fetches the query and the whole first
tile of K and V (their loads issued before the query's), and a context of at
most BLOCK_N keys is one dot, one softmax and one dot, with no merge pass.
Longer contexts continue with the split kernel's masked tile loop
(attention_tile.py).

EARLY_KV (off by default): every key and value of the tile but the step's own
token's were written by earlier steps, so they can be read before the wait
too, and after it only the query and the new token's key and value, one
[2, head_dim] read whose column starts the softmax state (in the sm_90 code
every tile load and its shared-memory store then come before the wait). Alone
that is one round trip more; it pays only where the kernel before runs long
enough to hide it.

Rows of the tile are the GQA group's query heads (padded to 16 for the tensor
cores), so each K/V tile is read once for the group. A quantized cache (int8 /
fp8 codes with per-token scales) is read as codes, converted to the query's
dtype in registers; K's scale multiplies the score column and V's the
probability (attention_tile.py's QUANT path; with an fp16 query that product
can sink into fp16's subnormals for small scales, so decode_attention keeps the
split kernel's rescaling code paths there). The grid is (requests, KV heads):
fixed per batch size, so a decode step with it can be captured in a CUDA graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from slipstream.kernels.attention_tile import (
    LOG2E, attend_paged_keys, check_kv_scales, exact_dot, next_pow2, softmax_tile_update)
from slipstream.kernels.runtime import interpreting, num_sms, pdl_supported

# BLOCK_N: keys of the peeled first tile (contexts up to it take one tile).
# Compiled for sm_90 (bf16 cache, GQA 4, head dim 128): 256 keys in 8 warps
# (198 registers, 141 KB shared memory, one program an SM) for up to one
# program an SM; beyond that 64 keys in 4 warps (124 registers, 39 KB).
# Measured alone (H200, benchmarks/runtime/bench_decode_kernels.py, commit
# 0804f41; CUDA graphs, K/V from HBM), 128-token contexts, bf16 cache: batch 1
# 6.5 us (256 keys, 8 warps, EARLY_KV off), 7.8 (EARLY_KV on), 6.2 (128 keys,
# 4 warps) against 10.0 for the unsplit split-KV kernel (both of those two
# figures include a ~1.8 us index kernel the benchmark ran before the old one);
# batch 8 7.1 against 10.5; batch 64 16.8 (64 keys, 4 warps) against 16.3;
# int8 / fp8 caches, batch 1: 7.3-9.4 against 8.7 / 8.3 (the split kernel's
# fp16 / int8 code paths, code_tile.py). Hence `short_decode_default`.
FEW_CONFIG = {"BLOCK_N": 256, "num_warps": 8, "num_stages": 3}
MANY_CONFIG = {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
INTERPRET_CONFIG = {"BLOCK_N": 16, "num_warps": 4, "num_stages": 1}


@triton.jit(do_not_specialize=["max_blocks", "qk_scale"])
def _short_decode_kernel(
        Q, KCache, VCache, KScale, VScale, Out, SeqLens, BlockTables, max_blocks,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_cb, stride_cs, stride_ch, stride_sb, stride_ss, stride_bt, qk_scale,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
        QUANT: tl.constexpr, CHAIN: tl.constexpr, EARLY_KV: tl.constexpr, TRIGGER: tl.constexpr):
    if TRIGGER:  # a kernel after it launched as a programmatic dependent may start now
        gdc_launch_dependents()
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    # Nothing before the wait reads what the kernel before writes: the lengths
    # and block tables come from the host.
    seq_len = tl.load(SeqLens + seq)
    bt_row = BlockTables + seq.to(tl.int64) * stride_bt
    pos = tl.arange(0, BLOCK_N)
    if PAGE_SIZE >= BLOCK_N:
        page = tl.load(bt_row).to(tl.int64)
    else:  # every entry of the tile, in range of the table, whatever the length
        page = tl.load(bt_row + pos // PAGE_SIZE, mask=pos // PAGE_SIZE < max_blocks,
                       other=0).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    # The first tile: keys [0, BLOCK_N), those < seq_len read.
    key_ok = pos < seq_len
    offs = page * stride_cb + (pos % PAGE_SIZE) * stride_cs + kv_head * stride_ch
    k_ptrs = KCache + offs[None, :] + offs_d[:, None]
    v_ptrs = VCache + offs[:, None] + offs_d[None, :]
    s_offs = page * stride_sb + (pos % PAGE_SIZE) * stride_ss + kv_head
    if EARLY_KV:
        # Every key but the step's own was written by an earlier step: the tile
        # reads them before the wait, so the reads overlap the kernel before.
        key_ok = pos < seq_len - 1
        k = tl.load(k_ptrs, mask=key_ok[None, :] & d_ok[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=key_ok[:, None] & d_ok[None, :], other=0.0)
        if QUANT:
            k_scale = tl.load(KScale + s_offs, mask=key_ok, other=0.0)
            v_scale = tl.load(VScale + s_offs, mask=key_ok, other=0.0)
        # Where the new token's key and value lie, when in the first tile.
        last = seq_len - 1
        in_tile = (last >= 0) & (last < BLOCK_N)
        last_page = tl.load(bt_row + last // PAGE_SIZE, mask=in_tile, other=0).to(tl.int64)
        last_offs = last_page * stride_cb + (last % PAGE_SIZE) * stride_cs + kv_head * stride_ch
        last_s = last_page * stride_sb + (last % PAGE_SIZE) * stride_ss + kv_head
    if CHAIN:  # launched early: the query and the new token's K/V may still be being written
        gdc_wait()
    if not EARLY_KV:
        k = tl.load(k_ptrs, mask=key_ok[None, :] & d_ok[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=key_ok[:, None] & d_ok[None, :], other=0.0)
        if QUANT:
            k_scale = tl.load(KScale + s_offs, mask=key_ok, other=0.0)
            v_scale = tl.load(VScale + s_offs, mask=key_ok, other=0.0)
    # The query after the tile: its conversion for the dot waits on its load, and
    # the tile's loads are then already in flight.
    rows = tl.arange(0, BLOCK_M)
    head = kv_head * GROUP + rows
    row_ok = rows < GROUP
    q = tl.load(Q + seq.to(tl.int64) * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    qk = exact_dot(q, k.to(q.dtype))
    if QUANT:
        qk = qk * k_scale[None, :]
    else:
        v_scale = 1.0
    m_i = tl.full([BLOCK_M], -1.0e6, tl.float32)  # (attention_tile.MASKED_SCORE)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    if EARLY_KV:
        # The new token's key and value, when in the first tile: the softmax
        # state starts from that one column (a masked score, wiped by the tile,
        # when it is not there). Key and value are one [2, D] load whose key
        # row the state needs first, so the load is issued with the query's.
        two = tl.arange(0, 2)
        is_k = (two == 0)[:, None]
        kv_ptrs = tl.where(is_k, KCache, VCache) + last_offs + offs_d[None, :]
        kv_new = tl.load(kv_ptrs, mask=in_tile & d_ok[None, :], other=0.0).to(tl.float32)
        if QUANT:
            kv_new = kv_new * tl.load(tl.where(two == 0, KScale, VScale) + last_s, mask=in_tile,
                                      other=0.0)[:, None]
        k_new = tl.sum(tl.where(is_k, kv_new, 0.0), 0)
        v_new = tl.sum(tl.where(is_k, 0.0, kv_new), 0)
        m_i = tl.where(in_tile, tl.sum(q.to(tl.float32) * k_new[None, :], 1) * qk_scale, m_i)
        l_i += 1.0
        acc += v_new[None, :]
    acc, m_i, l_i = softmax_tile_update(acc, m_i, l_i, qk, v.to(q.dtype), qk_scale,
                                        key_ok[None, :], True, v_scale, QUANT)
    # The rest, if any, a masked tile at a time (the decode query sees every key).
    acc, m_i, l_i = attend_paged_keys(
        acc, m_i, l_i, q, KCache, VCache, KScale, VScale, bt_row, kv_head, BLOCK_N, seq_len,
        seq_len, rows, 0, qk_scale, stride_cb, stride_cs, stride_ch, stride_sb, stride_ss,
        rows.to(tl.int64), 0, HEAD_DIM, HEAD_DIM_PAD, BLOCK_N, PAGE_SIZE, False, False, False,
        True, QUANT)
    # An empty request (a padded graph row) writes zeros, not 0 / 0.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(Out + seq.to(tl.int64) * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def short_decode_default(programs: int, quantized: bool, device) -> bool:
    """Whether decode_attention picks this kernel for a short-context step of
    `programs` (requests x KV heads) programs: with a 16-bit cache and at most
    one program an SM (measured faster there; see FEW_CONFIG's note)."""
    if quantized:
        return False
    sms = num_sms(device.index or 0) if device.type == "cuda" else 132
    return programs <= sms


def launch_config(programs: int, device) -> dict:
    if interpreting():
        return INTERPRET_CONFIG
    return FEW_CONFIG if programs <= num_sms(device.index or 0) else MANY_CONFIG


def short_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float, *,
                           out: torch.Tensor | None = None, config: dict | None = None,
                           k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per request attending to its whole paged context (itself
    included), no sliding window. Correct for any length; fastest when most
    contexts fit the first tile (config BLOCK_N keys).

    q: [num_seqs, num_heads, head_dim] (last dim contiguous); k_cache, v_cache:
    [num_blocks, page_size, num_kv_heads, head_dim]; seq_lens: [num_seqs] int32;
    block_tables: [num_seqs, max_blocks] int32; k_scale, v_scale: [num_blocks,
    page_size, num_kv_heads] fp32 for an int8 / fp8 cache, else None. config:
    overrides of the launch config (BLOCK_N, num_warps, num_stages, CHAIN, EARLY_KV,
    TRIGGER).
    returns out: [num_seqs, num_heads, head_dim] in q's dtype.
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, page_size = k_cache.shape[2], k_cache.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if page_size & (page_size - 1):
        raise ValueError(f"page size must be a power of two, got {page_size}")
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and k_cache.stride() == v_cache.stride()
    assert seq_lens.shape == (num_seqs,) and block_tables.shape[0] >= num_seqs
    quant = check_kv_scales(k_cache, v_cache, k_scale, v_scale)
    if out is None:
        out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    cfg = {**launch_config(num_seqs * num_kv_heads, q.device), **(config or {})}
    block_n = cfg.pop("BLOCK_N")
    chain = cfg.pop("CHAIN", True) and pdl_supported(q)
    # Off by default: alone it costs a round trip more (7.8 against 6.5 us above);
    # chained after the KV store, where its reads overlap that kernel, not measured.
    early = cfg.pop("EARLY_KV", False)
    # Lets a kernel after it that reads only its own inputs before its wait start
    # early (the decode GEMV in benchmarks/runtime/decode_gemv_cases.py).
    trigger = cfg.pop("TRIGGER", False) and pdl_supported(q)
    _short_decode_kernel[(num_seqs, num_kv_heads)](
        q, k_cache, v_cache, *(k_scale, v_scale) if quant else (k_cache, v_cache), out,
        seq_lens, block_tables, block_tables.shape[1],
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        *(k_scale.stride()[:2] if quant else (0, 0)), block_tables.stride(0),
        scale * LOG2E,
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=next_pow2(head_dim),
        BLOCK_M=max(16, next_pow2(group)), BLOCK_N=block_n, PAGE_SIZE=page_size, QUANT=quant,
        CHAIN=chain, EARLY_KV=early, TRIGGER=trigger, launch_pdl=chain, **cfg)
    return out

"""Plain-PyTorch twins of the attention kernels.

These are the ground truth the Triton kernels are tested against, and the
torch attention backend runs on them, so they favour clarity over speed.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write new keys/values into the paged cache.

    k, v: [num_tokens, num_kv_heads, head_dim]
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: [num_tokens] int64, block * block_size + offset; -1 skips a token
    """
    num_blocks, block_size = k_cache.shape[:2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(num_blocks * block_size, *k_cache.shape[2:])[slots] = k[keep].to(k_cache.dtype)
    v_cache.view(num_blocks * block_size, *v_cache.shape[2:])[slots] = v[keep].to(v_cache.dtype)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of one request: [length, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    return cache[block_table[:num_blocks].long()].flatten(0, 1)[:length]


def attention_mask(query_len: int, seq_len: int, device: torch.device,
                   sliding_window: int | None = None,
                   tree_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Which keys each query token may see: [query_len, seq_len] bool.

    Query token t sits at position ctx + t (ctx = seq_len - query_len). It sees
    every cached key, the step's keys up to itself (or its tree ancestors when
    `tree_mask` [query_len, query_len] is given), and with a sliding window only
    keys j with pos - j < sliding_window.
    """
    ctx = seq_len - query_len
    q_pos = torch.arange(ctx, seq_len, device=device)[:, None]
    k_pos = torch.arange(seq_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if tree_mask is not None:
        mask = mask.clone()
        mask[:, ctx:] = tree_mask[:query_len, :query_len].to(torch.bool)
    if sliding_window is not None:
        mask &= (q_pos - k_pos) < sliding_window
    return mask


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    query_start_loc: list[int], seq_lens: list[int], block_tables: torch.Tensor,
                    scale: float, sliding_window: int | None = None,
                    tree_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Variable-length attention over a paged KV cache (prefill, chunked prefill,
    decode and tree verification are all this one function).

    q: [num_tokens, num_heads, head_dim]; the new K/V must already be in the cache.
    query_start_loc: num_seqs + 1 host ints; seq_lens: num_seqs host ints.
    block_tables: [num_seqs, max_blocks] int32.
    tree_mask: optional [num_seqs, max_query_len, max_query_len] bool.
    returns [num_tokens, num_heads, head_dim] in q's dtype.
    """
    out = torch.empty_like(q)
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    for i, seq_len in enumerate(seq_lens):
        qs, qe = query_start_loc[i], query_start_loc[i + 1]
        if qe == qs:
            continue
        k = gather_kv(k_cache, block_tables[i], seq_len).to(q.dtype)
        v = gather_kv(v_cache, block_tables[i], seq_len).to(q.dtype)
        mask = attention_mask(qe - qs, seq_len, q.device, sliding_window,
                              None if tree_mask is None else tree_mask[i])
        o = F.scaled_dot_product_attention(
            q[qs:qe].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
            attn_mask=mask, scale=scale, enable_gqa=num_heads != num_kv_heads)
        out[qs:qe] = o.transpose(0, 1)
    return out

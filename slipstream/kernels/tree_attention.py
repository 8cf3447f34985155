"""Tree attention: verify a draft tree in one step (Medusa / EAGLE).

Each request brings several query tokens, the nodes of a draft tree, laid out
after its context in the paged cache. Node t sees the whole context and the
nodes `tree_mask[i, t, :]` marks (its ancestors and itself); positions follow
the reference: node t sits at context_len + t.

The work is decode-shaped (few queries, long context), so it runs on the
split-KV kernel of decode_attention.py with rows spanning (node, head of the
KV group): one load of each K/V tile serves every node and every head of a
group, and the context is split across programs when the batch is small.
"""
from __future__ import annotations

import torch

from slipstream.kernels.decode_attention import (
    MAX_TREE_NODES, choose_num_splits, split_kv_attention)


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """The tree mask of one draft tree given each node's parent (-1 for the
    root, parents before children): [n, n] bool, row t = t and its ancestors."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for t in range(n):
        j = t
        while j >= 0:
            mask[t, j] = True
            j = parents[j]
    return mask


def tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                   block_tables: torch.Tensor, tree_mask: torch.Tensor, scale: float, *,
                   max_query_len: int, max_seq_len: int, sliding_window: int | None = None,
                   num_splits: int | None = None, out: torch.Tensor | None = None,
                   scratch: tuple[torch.Tensor, torch.Tensor] | None = None,
                   config: dict | None = None, k_scale: torch.Tensor | None = None,
                   v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim] (the tree nodes of every request,
    their K/V already stored); cu_seqlens_q: [num_seqs + 1] int32; seq_lens:
    [num_seqs] int32 (context + nodes); tree_mask: [num_seqs, max_query_len,
    max_query_len] bool, row t = the nodes node t may see (at most 64 nodes).
    max_query_len, max_seq_len: host ints. k_scale, v_scale: the scale pools of
    a quantized (int8 / fp8) cache, else None. returns [num_tokens, num_heads, head_dim].
    """
    if tree_mask.dim() != 3 or tree_mask.shape[1] < max_query_len or tree_mask.shape[2] < max_query_len:
        raise ValueError(f"tree_mask must be [num_seqs, >={max_query_len}, >={max_query_len}], "
                         f"got {tuple(tree_mask.shape)}")
    if max_query_len > MAX_TREE_NODES:
        raise ValueError(f"draft trees of at most {MAX_TREE_NODES} nodes are supported, "
                         f"got {max_query_len}")
    if num_splits is None:
        num_splits = choose_num_splits(cu_seqlens_q.shape[0] - 1, k_cache.shape[2], max_seq_len,
                                       max_query_len=max_query_len,
                                       group=q.shape[1] // k_cache.shape[2])
    return split_kv_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables,
                              max_query_len, scale, num_splits, sliding_window,
                              pack_tree_mask(tree_mask[:, :max_query_len, :max_query_len]),
                              out, scratch, config, k_scale, v_scale)


def pack_tree_mask(tree_mask: torch.Tensor) -> torch.Tensor:
    """[num_seqs, n, m] bool (row t: the step's tokens token t may see) ->
    [num_seqs, n] int64 bitmasks, bit j set when token j is visible; m <= 64."""
    m = tree_mask.shape[-1]
    if m > MAX_TREE_NODES:
        raise ValueError(f"tree masks of at most {MAX_TREE_NODES} nodes are supported, got {m}")
    weights = torch.ones(m, dtype=torch.int64, device=tree_mask.device) << torch.arange(
        m, dtype=torch.int64, device=tree_mask.device)
    # Distinct powers of two: the sum is the bitwise or (bit 63 wraps to the sign).
    return (tree_mask.to(torch.bool).to(torch.int64) * weights).sum(-1)

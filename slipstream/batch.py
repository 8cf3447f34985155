"""The per-step input of a model forward: flattened tokens plus attention metadata.

A step mixes requests freely: each contributes `query_len` new tokens (a prompt
chunk, one decode token, or a decode token plus draft tokens) that attend to its
`context_len` tokens already in the paged KV cache and, causally, to each other.

Invariants (for request i, with q_i = query_start_loc[i+1] - query_start_loc[i]):
  seq_lens[i] = context_lens[i] + q_i
  token j of request i sits at position context_lens[i] + j
  its K/V goes to slot_mapping[t] = block * block_size + offset (never -1 for real tokens)
  block_tables[i, k] is the k-th KV block of request i (rows padded with 0)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import numpy as np


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor        # [num_tokens] int64
    positions: torch.Tensor        # [num_tokens] int64
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor         # [num_seqs] int32, context + query tokens
    context_lens: torch.Tensor     # [num_seqs] int32, tokens already in the cache
    slot_mapping: torch.Tensor     # [num_tokens] int64
    block_tables: torch.Tensor     # [num_seqs, max_blocks_per_seq] int32
    logits_indices: torch.Tensor   # [num_logits] int64, rows of the hidden states to project
    # Host-side copies of the few scalars kernels need to size their grids,
    # so launchers never read device tensors back (no sync on the hot path).
    max_query_len: int
    max_seq_len: int
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    # Optional [num_seqs, max_query_len, max_query_len] bool mask among the query
    # tokens of each request (draft-tree verification); None means causal.
    tree_mask: torch.Tensor | None = None
    # tree_mask already packed ([num_seqs, max_query_len] int64, bit j of row t: token
    # t sees token j; kernels/tree_attention.pack_tree_mask), for backends that read
    # bits (`takes_tree_bits`); with it they ignore tree_mask's contents.
    tree_bits: torch.Tensor | None = None
    # The first `num_decode_seqs` requests bring one token each (decodes come first
    # in a step), so a backend can send them to its decode kernel.
    num_decode_seqs: int = 0
    # Fixed split-KV count for decode steps (a captured CUDA graph); None: the
    # backend chooses from max_seq_len.
    decode_splits: int | None = None
    # False: no one reads this step's feature taps (`LlamaModel.feature_taps`; an EAGLE-3
    # head's input), so the forward returns the final states alone. Set only for steps
    # that run eagerly: a captured graph keeps the taps its capture had.
    features: bool = True
    # Host copies of slot_mapping and block_tables (numpy) where the batch builder has
    # them, for caches whose bookkeeping runs on the host (a KIVI cache's window);
    # None: read back from the device tensors.
    slot_mapping_host: np.ndarray | None = None
    block_tables_host: np.ndarray | None = None

    def host_block_tables(self):
        """The block tables on the host where the batch builder kept them, else the
        device tensor (rows are then read back)."""
        return self.block_tables if self.block_tables_host is None else self.block_tables_host

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1

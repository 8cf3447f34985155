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
    from slipstream.engine.scheduler import ScheduledRequest


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

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


def build_forward_batch(scheduled: "list[ScheduledRequest]", block_size: int,
                        device: torch.device,
                        extra_logits_rows: "list[list[int]] | None" = None) -> ForwardBatch:
    """Flatten a step's scheduled requests into one ForwardBatch.

    Rows of `logits_indices`: first the last token of every request that
    samples this step (in schedule order), then, per request, the extra rows
    in `extra_logits_rows[i]` (offsets into that request's new tokens, e.g.
    prompt positions whose log-probabilities were asked for).
    """
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_lens: list[int] = []
    seq_lens: list[int] = []
    sample_rows: list[int] = []
    extra_rows: list[int] = []
    max_blocks = 1
    for i, s in enumerate(scheduled):
        start, n, table = s.context_len, s.num_new_tokens, s.block_ids
        base = len(input_ids)
        input_ids.extend(s.request.all_token_ids[start:start + n])
        positions.extend(range(start, start + n))
        slots.extend(table[p // block_size] * block_size + p % block_size
                     for p in range(start, start + n))
        query_lens.append(n)
        seq_lens.append(start + n)
        max_blocks = max(max_blocks, len(table))
        if s.samples:
            sample_rows.append(base + n - 1)
        if extra_logits_rows is not None:
            extra_rows.extend(base + j for j in extra_logits_rows[i])
    tables = [s.block_ids + [0] * (max_blocks - len(s.block_ids)) for s in scheduled]
    query_start_loc = [0]
    for n in query_lens:
        query_start_loc.append(query_start_loc[-1] + n)
    pin = device.type == "cuda"

    def to_dev(data, dtype):
        t = torch.tensor(data, dtype=dtype)
        return t.pin_memory().to(device, non_blocking=True) if pin else t

    return ForwardBatch(
        input_ids=to_dev(input_ids, torch.int64),
        positions=to_dev(positions, torch.int64),
        query_start_loc=to_dev(query_start_loc, torch.int32),
        seq_lens=to_dev(seq_lens, torch.int32),
        context_lens=to_dev([s.context_len for s in scheduled], torch.int32),
        slot_mapping=to_dev(slots, torch.int64),
        block_tables=to_dev(tables, torch.int32),
        logits_indices=to_dev(sample_rows + extra_rows, torch.int64),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
    )

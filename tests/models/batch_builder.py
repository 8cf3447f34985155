"""Test-side stand-ins for the runner: a paged KV pool and ForwardBatch building.

Each request owns a shuffled set of block ids, so a model that ignored the
block table or the slot mapping would read another request's (or an unwritten,
NaN-filled) slot.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from slipstream.batch import ForwardBatch


def allocate_kv_caches(model, num_blocks: int, block_size: int,
                       dtype: torch.dtype = torch.float32) -> None:
    """Give every attention layer k/v caches [num_blocks, block_size, kv_heads, head_dim],
    filled with NaN so that reading a slot nobody wrote poisons the output."""
    for layer in model.attention_layers():
        shape = (num_blocks, block_size, layer.num_kv_heads, layer.head_dim)
        layer.k_cache = torch.full(shape, float("nan"), dtype=dtype)
        layer.v_cache = torch.full(shape, float("nan"), dtype=dtype)


class BlockAllocator:
    """Hands out distinct block ids in a random order."""

    def __init__(self, num_blocks: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(num_blocks, generator=g).tolist()

    def take(self, n: int) -> list[int]:
        assert n <= len(self.free), "test KV pool too small"
        out, self.free = self.free[:n], self.free[n:]
        return out


@dataclass
class Sequence:
    """One request: its tokens, how many are already in the cache, its blocks."""
    token_ids: list[int]
    block_size: int
    allocator: BlockAllocator
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)

    def schedule(self, n: int) -> tuple[list[int], int]:
        """The next n tokens to compute and their context length; grows the block table."""
        ctx = self.num_computed
        assert ctx + n <= len(self.token_ids)
        need = -(-(ctx + n) // self.block_size) - len(self.block_table)
        if need > 0:
            self.block_table += self.allocator.take(need)
        self.num_computed += n
        return self.token_ids[ctx:ctx + n], ctx


def make_batch(steps: list[tuple[Sequence, int]]) -> ForwardBatch:
    """One ForwardBatch computing the next n tokens of each (sequence, n)."""
    ids, positions, slots, query_lens, seq_lens, ctx_lens, tables = [], [], [], [], [], [], []
    for seq, n in steps:
        new, ctx = seq.schedule(n)
        bs = seq.block_size
        ids += new
        pos = list(range(ctx, ctx + n))
        positions += pos
        slots += [seq.block_table[p // bs] * bs + p % bs for p in pos]
        query_lens.append(n)
        ctx_lens.append(ctx)
        seq_lens.append(ctx + n)
        tables.append(list(seq.block_table))
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    loc = [0]
    for n in query_lens:
        loc.append(loc[-1] + n)
    return ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        query_start_loc=torch.tensor(loc, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        context_lens=torch.tensor(ctx_lens, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=block_tables,
        logits_indices=torch.arange(len(ids), dtype=torch.int64),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
    )

"""A proposer's own paged KV cache, and ForwardBatch building over it.

The draft model (and anything else that runs a slipstream model to draft)
keeps its K/V apart from the target's: blocks from its own pool, one block
table per request, grown on demand. Rolling back rejected drafts costs
nothing: a request's `num_cached` is set back to the tokens it really has,
and the slots past it are overwritten by the next call.
"""
from __future__ import annotations

import torch

from slipstream.batch import ForwardBatch
from slipstream.spec.transfer import to_device


class DraftKVCache:
    def __init__(self, model, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str):
        self.block_size = block_size
        self.device = torch.device(device)
        layers = model.attention_layers()
        first = layers[0]
        # [layers, 2, blocks, block_size, kv_heads, head_dim], zeroed (finite) like the target's.
        self.pool = torch.zeros(len(layers), 2, num_blocks, block_size, first.num_kv_heads,
                                first.head_dim, dtype=dtype, device=self.device)
        self.layers = layers
        self.bind()
        self.free = list(range(num_blocks - 1, -1, -1))
        self.tables: dict[str, list[int]] = {}
        self.num_cached: dict[str, int] = {}

    def bind(self) -> None:
        """Point the model's attention layers at this pool (a model may serve
        several caches, e.g. answering prompts and then scoring them)."""
        for i, layer in enumerate(self.layers):
            layer.k_cache, layer.v_cache = self.pool[i, 0], self.pool[i, 1]

    def release(self, request_id: str) -> None:
        self.free.extend(self.tables.pop(request_id, []))
        self.num_cached.pop(request_id, None)

    def _grow(self, request_id: str, length: int) -> list[int]:
        table = self.tables.setdefault(request_id, [])
        need = -(-length // self.block_size) - len(table)
        if need > len(self.free):
            raise RuntimeError("the draft KV cache is full; give it more blocks")
        for _ in range(max(0, need)):
            table.append(self.free.pop())
        return table

    def batch(self, entries: list[tuple[str, torch.Tensor, int, list[int] | None]],
              tree_masks: list[torch.Tensor] | None = None) -> ForwardBatch:
        """entries: (request id, input ids [q] int64, context length c, positions
        or None for c .. c + q - 1). Query row t of a request writes slot c + t
        and sees the c cached tokens plus, with `tree_masks[i]` [q, q], the rows
        it marks (else rows <= t). Logits rows: every query row."""
        self.bind()
        bs = self.block_size
        ids, positions, slots, qlens, seqlens, ctx, tables = [], [], [], [], [], [], []
        for rid, tokens, c, pos in entries:
            q = tokens.shape[0]
            table = self._grow(rid, c + q)
            ids.append(tokens if tokens.device == self.device
                       else to_device(tokens, torch.int64, self.device))
            positions.extend(pos if pos is not None else range(c, c + q))
            slots.extend(table[p // bs] * bs + p % bs for p in range(c, c + q))
            qlens.append(q)
            seqlens.append(c + q)
            ctx.append(c)
            tables.append(table)
        width = max(len(t) for t in tables)
        loc = [0]
        for q in qlens:
            loc.append(loc[-1] + q)
        mask = None
        if tree_masks is not None:
            mq = max(qlens)
            mask = torch.eye(mq, dtype=torch.bool).repeat(len(entries), 1, 1)
            for i, m in enumerate(tree_masks):
                mask[i, :m.shape[0], :m.shape[0]] = m.cpu()
            mask = to_device(mask, torch.bool, self.device)

        def dev(x, dtype):
            return to_device(x, dtype, self.device)
        input_ids = torch.cat(ids)
        return ForwardBatch(
            input_ids=input_ids, positions=dev(positions, torch.int64),
            query_start_loc=dev(loc, torch.int32), seq_lens=dev(seqlens, torch.int32),
            context_lens=dev(ctx, torch.int32), slot_mapping=dev(slots, torch.int64),
            block_tables=dev([t + [0] * (width - len(t)) for t in tables], torch.int32),
            logits_indices=torch.arange(input_ids.shape[0], device=self.device),
            max_query_len=max(qlens), max_seq_len=max(seqlens),
            query_lens_cpu=qlens, seq_lens_cpu=seqlens, tree_mask=mask)

"""The reference attention backend: plain PyTorch, runs on CPU and GPU."""
from __future__ import annotations

import torch

from slipstream.attention.base import AttentionLayerInfo, register_backend
from slipstream.kernels import reference
from slipstream.runner.forward_batch import ForwardBatch


@register_backend("torch")
class TorchAttentionBackend:
    name = "torch"

    def prepare(self, batch: ForwardBatch) -> None:
        # Host copies of the request boundaries, computed once per step.
        loc = [0]
        for n in batch.query_lens_cpu:
            loc.append(loc[-1] + n)
        self._query_start_loc = loc

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                layer: AttentionLayerInfo, batch: ForwardBatch) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        reference.store_kv(k, v, layer.k_cache, layer.v_cache, batch.slot_mapping)
        return reference.paged_attention(
            q, layer.k_cache, layer.v_cache, self._query_start_loc, batch.seq_lens_cpu,
            batch.block_tables, layer.scale, layer.sliding_window, batch.tree_mask)

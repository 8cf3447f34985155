"""The attention backend protocol: the model never knows which kernel runs.

A backend writes the step's new K/V into the layer's paged cache (by
`batch.slot_mapping`) and attends every query token to its request's cached
context plus, causally (or by `batch.tree_mask`), to the step's earlier tokens.

KV cache layout, per layer (see `runner/memory.py`):
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    k_scale, v_scale: [num_blocks, block_size, num_kv_heads] fp32 for int8 / fp8
                      codes (one scale per token and head), else None
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol

import torch

if TYPE_CHECKING:
    from slipstream.batch import ForwardBatch


class AttentionLayerInfo(Protocol):
    """What a backend may read off the attention layer it serves."""
    layer_idx: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    # [num_blocks, block_size, num_kv_heads] fp32 when the caches hold int8 / fp8
    # codes (quant/kv_quant.py), else None
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None


class AttentionBackend(Protocol):
    name: str

    def prepare(self, batch: "ForwardBatch") -> None:
        """Called once per step before the first layer (per-step metadata)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                layer: AttentionLayerInfo, batch: "ForwardBatch",
                out: torch.Tensor | None = None) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        -> [num_tokens, num_heads, head_dim], written into `out` when given."""


_BACKENDS: dict[str, Callable[[], AttentionBackend]] = {}


def register_backend(name: str):
    def deco(factory):
        _BACKENDS[name] = factory
        return factory
    return deco

"""The attention layer: the model's handle on one layer's paged KV cache.

It holds what a backend may read (`attention.base.AttentionLayerInfo`) and
forwards q/k/v to the backend, which writes the new K/V into `k_cache` /
`v_cache` and attends. The runner sets the caches once the KV pool is
allocated; until then they are None.
"""
from __future__ import annotations

import torch
from torch import nn

from slipstream.attention.base import AttentionBackend
from slipstream.batch import ForwardBatch


class Attention(nn.Module):
    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 backend: AttentionBackend, scale: float | None = None,
                 sliding_window: int | None = None):
        super().__init__()
        assert num_heads % num_kv_heads == 0, "query heads must be a multiple of kv heads"
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.sliding_window = sliding_window
        self.backend = backend
        # Plain attributes, not buffers: the pool is the runner's, and `.to()`
        # or `state_dict()` on the model must not touch it.
        # k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        # A quantized cache's scales, [num_blocks, block_size, num_kv_heads] fp32
        # (k_cache / v_cache then hold int8 or fp8 codes); None for a 16-bit cache.
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        # A KIVI cache's blocks (cache/kivi_paged.py); k_cache / v_cache are then empty.
        self.kivi = None
        # Set while a step runs in pieces (runner/piecewise.py): called instead of
        # the backend, it ends one captured piece and starts the next.
        self.intercept = None

    def fuses_rotary(self, rope) -> bool:
        """Whether the backend applies `rope` (a StepRotary on its kernel path) itself,
        in the kernel that stores K/V: q and k are then passed unrotated."""
        return (rope.gathered is None and self.kivi is None
                and getattr(self.backend, "fuses_rotary", False))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                batch: ForwardBatch, rope=None) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        (strided views are allowed; the last dim is contiguous); rope: the step's
        rotary when q and k are unrotated (only if `fuses_rotary(rope)`: q and k
        are rotated in place) -> [num_tokens, num_heads, head_dim]"""
        if self.intercept is not None:
            return self.intercept(self, q, k, v, rope)
        if rope is not None:
            return self.backend.forward(q, k, v, self, batch, rope=rope)
        return self.backend.forward(q, k, v, self, batch)

    def extra_repr(self) -> str:
        return (f"layer={self.layer_idx}, heads={self.num_heads}, kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, sliding_window={self.sliding_window}, "
                f"backend={getattr(self.backend, 'name', type(self.backend).__name__)}")

"""Gated activations."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """SwiGLU's gate: silu(gate) * up for x = [gate | up] from a fused gate_up projection."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, 2 * d] -> [num_tokens, d]
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]

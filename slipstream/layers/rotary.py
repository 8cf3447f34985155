"""Rotary position embedding (RoPE), Hugging Face rotate-half ("neox") convention.

For x = [x1 | x2] (halves of head_dim) at position p with angles a = p * inv_freq:
    rope(x) = [x1 cos a - x2 sin a | x2 cos a + x1 sin a]
computed as x * cos + swap_halves(x) * signed_sin, with cos = [cos a | cos a] and
signed_sin = [-sin a | sin a] precomputed per position.

The tables are built in fp32 (as HF does) and stored in the default dtype at
construction, which `.to(dtype)` then converts with the rest of the model.

Once a step the model asks `for_step(positions)` for a `StepRotary`, which
every layer calls on the q and k heads of its fused qkv output at once. On
CUDA tensors that is one Triton kernel (`kernels/rotary.py`) rotating the
heads in place, reading cos/sin by position from the tables; elsewhere the
tables are gathered once a step (`lookup`) and `apply_rotary` returns a new
tensor, as before.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from slipstream.config import RopeScaling


class StepRotary:
    """One step's rotary: call it on qk [num_tokens, heads, head_dim] (a strided
    view of qkv) -> the rotated heads (the same tensor, rotated in place, on the
    kernel path; a new contiguous tensor on the torch path)."""

    def __init__(self, positions: torch.Tensor, cos_table: torch.Tensor,
                 sin_table: torch.Tensor, gathered: tuple[torch.Tensor, torch.Tensor] | None):
        self.positions = positions                  # [num_tokens]
        self.cos_table, self.sin_table = cos_table, sin_table  # [max_position, head_dim]
        self.gathered = gathered                    # torch path: cos, sin [num_tokens, 1, head_dim]

    def __call__(self, qk: torch.Tensor) -> torch.Tensor:
        if self.gathered is None:
            from slipstream.kernels.rotary import rotary_inplace
            return rotary_inplace(qk, self.positions, self.cos_table, self.sin_table)
        return apply_rotary(qk, *self.gathered)


def rope_inv_freq(head_dim: int, base: float, scaling: RopeScaling | None) -> torch.Tensor:
    """[head_dim // 2] fp32 inverse frequencies, with Llama-3 or linear scaling."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64)
                               .to(torch.float32) / head_dim))
    if scaling is None or scaling.rope_type == "default":
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"unsupported rope scaling {scaling.rope_type!r}")


def _llama3_inv_freq(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band in
    # between interpolated smoothly (Llama 3.1).
    old_len = s.original_max_position_embeddings
    low_freq_wavelen = old_len / s.low_freq_factor
    high_freq_wavelen = old_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos / signed-sin tables for positions [0, max_position)."""
    # None: the in-place kernel on CUDA tensors, torch elsewhere; True/False forces one path.
    use_kernel: bool | None = None

    def __init__(self, head_dim: int, max_position: int, base: float,
                 scaling: RopeScaling | None = None):
        super().__init__()
        assert head_dim % 2 == 0, "rotary dimension must be even"
        self.head_dim = head_dim
        self.max_position = max_position
        # Factories follow the default device (`with torch.device(...)`).
        inv_freq = rope_inv_freq(head_dim, base, scaling)
        pos = torch.arange(max_position, dtype=torch.float32)
        angles = pos[:, None] * inv_freq[None, :]           # [max_position, head_dim // 2]
        dtype = torch.get_default_dtype()
        cos, sin = angles.cos(), angles.sin()
        self.register_buffer("cos", torch.cat((cos, cos), -1).to(dtype), persistent=False)
        self.register_buffer("sin", torch.cat((-sin, sin), -1).to(dtype), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [num_tokens] int64 -> cos, signed sin: [num_tokens, 1, head_dim]"""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def for_step(self, positions: torch.Tensor) -> StepRotary:
        """positions: [num_tokens] int64 -> the step's rotary, shared by every layer."""
        if positions.is_cuda if self.use_kernel is None else self.use_kernel:
            return StepRotary(positions, self.cos, self.sin, None)
        return StepRotary(positions, self.cos, self.sin, self.lookup(positions))

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_position={self.max_position}"


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, num_heads, head_dim] (any strides) -> rotated, contiguous.

    cos, sin: [num_tokens, 1, head_dim] from `RotaryEmbedding.lookup`.
    """
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos, swapped, sin)

"""Activations quantized per token, as a W8A8 linear layer consumes them.

A W8A8 layer (quant/w8a8.py int8, quant/fp8.py float8 e4m3) multiplies codes, so its
input must be quantized per token first. When the kernel that produces that input can do
it on the way out (the fused residual-add + RMSNorm before qkv_proj and gate_up_proj, the
SiLU * up before down_proj), the layer receives `QuantizedRows` instead of a float tensor
and skips its own quantization; otherwise it quantizes with `quantize_activation`.
Both paths give the same codes (the kernels round as the PyTorch twins do).

    q      int8 or float8_e4m3fn [num_tokens, k]
    scale  fp32 [num_tokens, 1]        (x ~= q * scale)
    dtype  the activations' own dtype (the layer's output dtype)

`SLIPSTREAM_W8A8_FUSE=0` turns the producers' fusion off (comparison runs): the norms and
the SiLU then write float rows and each W8A8 layer quantizes its own input.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch

from slipstream.quant.primitives import quantize_fp8_rows, quantize_int8_rows

KINDS = ("int8", "fp8")


class QuantizedRows(NamedTuple):
    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


def quantize_activation(x: torch.Tensor, kind: str) -> QuantizedRows:
    """x [num_tokens, k] -> its per-token codes: one Triton kernel on CUDA, the PyTorch
    twins elsewhere."""
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")
    if x.is_cuda:
        from slipstream.kernels.quant_act import quantize_rows
        q, s = quantize_rows(x, kind)
    else:
        q, s = (quantize_int8_rows if kind == "int8" else quantize_fp8_rows)(x)
    return QuantizedRows(q, s, x.dtype)


def fusion_enabled() -> bool:
    return os.environ.get("SLIPSTREAM_W8A8_FUSE", "1") not in ("", "0")


def input_quant(layer) -> str | None:
    """The per-token format a linear layer wants its input in ("int8", "fp8"), if the
    kernel producing that input should quantize it; None: float rows."""
    kind = getattr(getattr(layer, "quant_method", None), "input_quant", None)
    return kind if kind in KINDS and fusion_enabled() else None

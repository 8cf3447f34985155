"""Gated activations."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.layers import decode_gemv


class SiluAndMul(nn.Module):
    """SwiGLU's gate: silu(gate) * up for x = [gate | up] from a fused gate_up projection.

    On CUDA tensors one Triton kernel (`kernels/silu_mul.py`) reads x once and
    writes the product; elsewhere the two torch ops below run (its twin).
    `quant` ("int8" / "fp8", set by the model when a W8A8 layer reads the output): the
    product comes out quantized per token (`QuantizedRows`, quant/activation.py)."""
    # None: the kernel on CUDA tensors, torch elsewhere; True/False forces one path.
    use_kernel: bool | None = None
    quant: str | None = None
    # Set by the model where a plain down projection reads the output (its
    # `gemv_role`): at one row on Hopper the product is left to its GEMV
    # (layers/decode_gemv.py).
    fold: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, 2 * d] -> [num_tokens, d]
        if self.fold and x.shape[0] == 1 and decode_gemv.row_fits(x, self.fold):
            return decode_gemv.FoldedSiluMul(x)
        kernel = x.is_cuda if self.use_kernel is None else self.use_kernel
        if kernel and self.quant is not None:
            from slipstream.kernels.silu_mul import silu_and_mul_quant
            from slipstream.quant.activation import QuantizedRows
            return QuantizedRows(*silu_and_mul_quant(x, self.quant), x.dtype)
        if kernel:
            from slipstream.kernels.silu_mul import silu_and_mul
            return silu_and_mul(x)
        d = x.shape[-1] // 2
        out = F.silu(x[..., :d]) * x[..., d:]
        if self.quant is not None:
            from slipstream.quant.activation import quantize_activation
            out = quantize_activation(out, self.quant)
        return out

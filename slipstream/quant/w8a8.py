"""Int8 W8A8 linear method (SmoothQuant's runtime): int8 weights with one scale per output
channel, activations quantized to int8 per token at run time, int8 x int8 products
accumulated in int32, then rescaled by x_scale[token] * w_scale[channel].

    weight        int8 [out, in]
    weight_scale  fp32 [out]

The smoothing itself (moving activation outliers into the weights) happens offline in
quant/smoothquant.py and is folded into the previous RMSNorm (or linear) weights, so at
run time it costs nothing. Scheme "w8a8" quantizes a float checkpoint at load without
smoothing; `slipstream quantize --method smoothquant` writes a smoothed one.

The activations arrive quantized from the kernel that produced them (the fused norm or
SiLU, see quant/activation.py) or are quantized here (one Triton kernel on CUDA). On CUDA
the int32 GEMM is the Triton kernel of kernels/w8a8_gemm.py; on the CPU `torch._int_mm`
(exact integer arithmetic in both).
"""
from __future__ import annotations

import torch
from torch import nn

from slipstream.kernels import reference
from slipstream.quant.activation import QuantizedRows, quantize_activation
from slipstream.quant.base import register_scheme
from slipstream.quant.primitives import quantize_int8_rows


def _param(t: torch.Tensor, output_dim: int | None = 0) -> nn.Parameter:
    p = nn.Parameter(t, requires_grad=False)
    p.output_dim = output_dim
    return p


def quantize_weight_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (int8 [out, in], scale [out] fp32), symmetric per output channel."""
    q, s = quantize_int8_rows(w)
    return q, s.flatten()


class Int8W8A8Method:
    input_quant = "int8"    # the producer of this layer's input may quantize it (activation.py)

    def __init__(self, prequantized: bool = False):
        self.prequantized = prequantized
        # Tensor parallel as Fp8Method: per-row weight scales of the whole row, activations
        # per token over the rank's slice of a row-parallel input.
        self.tp_shardable = True

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        out = sum(output_sizes)
        dtype = torch.int8 if self.prequantized else params_dtype
        layer.register_parameter("weight", _param(torch.empty(out, input_size, dtype=dtype)))
        layer.weight.input_dim = 1
        if self.prequantized:
            layer.register_parameter("weight_scale", _param(torch.empty(out)))
            layer.weight_scale.tp_replicated = True

    def process_after_loading(self, layer: nn.Module) -> None:
        if not self.prequantized:
            from slipstream.layers.linear import quantize_whole_rows
            wq, ws = quantize_whole_rows(layer, layer.weight.data, quantize_weight_int8)
            layer.register_parameter("weight", _param(wq))
            layer.register_parameter("weight_scale", _param(ws))
        layer.weight_t = layer.weight.data.t()   # [in, out] view for torch._int_mm

    def apply(self, layer: nn.Module, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        # x: [num_tokens, in] (or its int8 rows) -> [num_tokens, out]
        xr = x if isinstance(x, QuantizedRows) else quantize_activation(x, "int8")
        xq, xs = xr.q, xr.scale
        if xq.is_cuda:
            from slipstream.kernels.w8a8_gemm import w8a8_gemm
            y = w8a8_gemm(xq, xs, layer.weight, layer.weight_scale, xr.dtype)
        elif hasattr(torch, "_int_mm"):
            acc = torch._int_mm(xq, layer.weight_t)            # [num_tokens, out] int32
            y = (acc.float() * xs * layer.weight_scale[None, :]).to(xr.dtype)
        else:
            y = reference.w8a8_linear(xq, xs, layer.weight, layer.weight_scale, xr.dtype)
        return y if layer.bias is None else y + layer.bias


@register_scheme("w8a8")
def _w8a8(config, files):
    from slipstream.quant.rtn import _dense_layers
    return _dense_layers(config, files, Int8W8A8Method)

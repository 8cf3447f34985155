"""Int8 W8A8 linear method (SmoothQuant's runtime): int8 weights with one scale per output
channel, activations quantized to int8 per token at run time, int8 x int8 products
accumulated in int32, then rescaled by x_scale[token] * w_scale[channel].

    weight        int8 [out, in]
    weight_scale  fp32 [out]

The smoothing itself (moving activation outliers into the weights) happens offline in
quant/smoothquant.py and is folded into the previous RMSNorm (or linear) weights, so at
run time it costs nothing. Scheme "w8a8" quantizes a float checkpoint at load without
smoothing; `slipstream quantize --method smoothquant` writes a smoothed one.

On CUDA the activations are quantized by one Triton kernel (kernels/quant_act.py) and the
int32 GEMM is the Triton kernel of kernels/quant_gemm.py; on the CPU `torch._int_mm` (exact
integer arithmetic in both).
"""
from __future__ import annotations

import torch
from torch import nn

from slipstream.kernels import reference
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
    def __init__(self, prequantized: bool = False):
        self.prequantized = prequantized

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        out = sum(output_sizes)
        dtype = torch.int8 if self.prequantized else params_dtype
        layer.register_parameter("weight", _param(torch.empty(out, input_size, dtype=dtype)))
        if self.prequantized:
            layer.register_parameter("weight_scale", _param(torch.empty(out)))

    def process_after_loading(self, layer: nn.Module) -> None:
        if not self.prequantized:
            wq, ws = quantize_weight_int8(layer.weight.data)
            layer.register_parameter("weight", _param(wq))
            layer.register_parameter("weight_scale", _param(ws))
        layer.weight_t = layer.weight.data.t()   # [in, out] view for torch._int_mm

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, in] -> [num_tokens, out]
        if x.is_cuda:
            from slipstream.kernels.quant_act import quantize_rows
            from slipstream.kernels.quant_gemm import w8a8_gemm
            xq, xs = quantize_rows(x, "int8")
            y = w8a8_gemm(xq, xs, layer.weight, layer.weight_scale, x.dtype)
            return y if layer.bias is None else y + layer.bias
        xq, xs = quantize_int8_rows(x)
        if hasattr(torch, "_int_mm"):
            acc = torch._int_mm(xq, layer.weight_t)            # [num_tokens, out] int32
            y = (acc.float() * xs * layer.weight_scale[None, :]).to(x.dtype)
        else:
            y = reference.w8a8_linear(xq, xs, layer.weight, layer.weight_scale, x.dtype)
        return y if layer.bias is None else y + layer.bias


@register_scheme("w8a8")
def _w8a8(config, files):
    from slipstream.quant.rtn import _dense_layers
    return _dense_layers(config, files, Int8W8A8Method)

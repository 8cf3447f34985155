"""FP8 W8A8 linear method: float8 e4m3 weights with one scale per output channel,
activations quantized per token at run time (dynamic), the product in fp8.

    weight        float8_e4m3fn [out, in]
    weight_scale  fp32 [out]

Scheme "fp8" quantizes a float checkpoint as it loads (the format H100/H200 users serve
with). On CUDA with bf16 activations the product is `torch._scaled_mm` with row-wise scales
(fp8 tensor cores, fp32 accumulation) or the Triton W8A8 kernel, whichever tuning finds
faster for the shape and token count (kernels/w8a8_gemm.py; `SLIPSTREAM_FP8_GEMM` forces
one); the activations arrive quantized from the kernel that produced them (the fused norm
or SiLU, see quant/activation.py) or are quantized here (one Triton kernel). Elsewhere
the plain-PyTorch reference dequantizes and multiplies in fp32, which gives the same
rounding of the inputs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.quant.activation import QuantizedRows, quantize_activation
from slipstream.quant.base import register_scheme
from slipstream.quant.primitives import quantize_fp8_rows


def _param(t: torch.Tensor, output_dim: int | None = 0) -> nn.Parameter:
    p = nn.Parameter(t, requires_grad=False)
    p.output_dim = output_dim
    return p


def fp8_linear_reference(xq, x_scale, wq, w_scale, out_dtype):
    """xq fp8 [m, k], x_scale [m, 1], wq fp8 [n, k], w_scale [n] -> [m, n] out_dtype."""
    return (F.linear(xq.float() * x_scale, wq.float()) * w_scale[None, :]).to(out_dtype)


class Fp8Method:
    input_quant = "fp8"     # the producer of this layer's input may quantize it (activation.py)

    def __init__(self, prequantized: bool = False):
        self.prequantized = prequantized
        # Tensor parallel: a rank loads its shard (a float one quantized with the whole
        # row's scale, or the checkpoint's codes with their per-row scales). Its
        # activations are quantized per token over the rank's slice of a row-parallel
        # layer's input: finer than one process, so not bit-identical to it.
        self.tp_shardable = True

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        out = sum(output_sizes)
        if self.prequantized:
            layer.register_parameter("weight", _param(torch.empty(out, input_size,
                                                                  dtype=torch.float8_e4m3fn)))
            layer.register_parameter("weight_scale", _param(torch.empty(out)))
            layer.weight.input_dim = 1
            layer.weight_scale.tp_replicated = True
        else:
            w = _param(torch.empty(out, input_size, dtype=params_dtype))
            w.input_dim = 1
            layer.register_parameter("weight", w)

    def process_after_loading(self, layer: nn.Module) -> None:
        if not self.prequantized:
            from slipstream.layers.linear import quantize_whole_rows
            wq, ws = quantize_whole_rows(layer, layer.weight.data, quantize_fp8_rows)
            layer.register_parameter("weight", _param(wq))
            layer.register_parameter("weight_scale", _param(ws.flatten()))

    def apply(self, layer: nn.Module, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        # x: [num_tokens, in] (or its fp8 rows) -> [num_tokens, out]
        xr = x if isinstance(x, QuantizedRows) else quantize_activation(x, "fp8")
        xq, xs = xr.q, xr.scale
        if xq.is_cuda and xr.dtype == torch.bfloat16:   # fp8 tensor cores (sm_89+)
            from slipstream.kernels.w8a8_gemm import w8a8_gemm
            y = w8a8_gemm(xq, xs, layer.weight, layer.weight_scale, xr.dtype)
        else:
            y = fp8_linear_reference(xq, xs, layer.weight, layer.weight_scale, xr.dtype)
        return y if layer.bias is None else y + layer.bias


@register_scheme("fp8")
def _fp8(config, files):
    from slipstream.quant.rtn import _dense_layers
    return _dense_layers(config, files, Fp8Method)

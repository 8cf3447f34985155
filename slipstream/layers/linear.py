"""Linear layers and the `QuantMethod` hook that owns their weights.

A linear layer holds a `QuantMethod`, which creates the layer's weight
parameters, post-processes them once loaded (repacking, transposing) and runs
the product. Unquantized fp32/fp16/bf16 is just `UnquantizedLinearMethod`, so a
quantization scheme plugs in without touching the model.

Fused layers (`QKVLinear`, `MergedLinear`) stack several checkpoint matrices
along the output dimension so one matmul computes them all; their
`weight_loader` copies each checkpoint shard into its slice.

Tensor-parallel naming: a column-parallel layer would split its output features
across ranks, a row-parallel one its input features (followed by an
all-reduce). Only `tp_size == 1` exists today; the names mark where the split
goes.

Parameter attributes the loaders read:
    output_dim: which dim of the parameter indexes output features (None: not per-output)
    weight_loader: the loader `load_weights` calls for this parameter
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.errors import ModelLoadError
from slipstream.layers.weight_loader import copy_checked


class QuantMethod(Protocol):
    """How a linear layer stores its weight and computes y = x W^T + b."""

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        """Register the weight parameters on `layer` (bias is the layer's own).

        output_sizes: the output features of each fused shard, in order.
        Set `param.output_dim` on each parameter so shards can be sliced.
        """

    def process_after_loading(self, layer: nn.Module) -> None:
        """Called once after all weights are loaded (repack, transpose, ...)."""

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, input_size] -> [num_tokens, output_size], adding `layer.bias`."""


class UnquantizedLinearMethod:
    """The identity method: a dense weight [output_size, input_size] and F.linear."""

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        weight = nn.Parameter(torch.empty(sum(output_sizes), input_size, dtype=params_dtype),
                              requires_grad=False)
        weight.output_dim = 0
        layer.register_parameter("weight", weight)

    def process_after_loading(self, layer: nn.Module) -> None:
        pass

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)


class LinearBase(nn.Module):
    """y = x W^T (+ b) through a QuantMethod; one checkpoint tensor per parameter."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 quant_method: QuantMethod | None = None, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        if tp_size != 1:
            raise NotImplementedError("tensor parallelism is not implemented yet")
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        self.output_size = sum(output_sizes)
        self.quant_method = quant_method or UnquantizedLinearMethod()
        params_dtype = torch.get_default_dtype()
        self.quant_method.create_weights(self, input_size, self.output_sizes, params_dtype)
        if bias:
            b = nn.Parameter(torch.empty(self.output_size, dtype=params_dtype), requires_grad=False)
            b.output_dim = 0
            self.register_parameter("bias", b)
        else:
            self.register_parameter("bias", None)
        # A quant method may attach its own loader to a parameter; the rest use the layer's.
        for p in self.parameters(recurse=False):
            if not hasattr(p, "weight_loader"):
                p.weight_loader = self.weight_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, input_size] -> [num_tokens, output_size]
        return self.quant_method.apply(self, x)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: object = None) -> None:
        if shard_id is not None:
            raise ModelLoadError(f"{type(self).__name__} has no shard {shard_id!r}")
        copy_checked(param.data, loaded_weight)

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_sizes}, bias={self.bias is not None}, "
                f"quant={type(self.quant_method).__name__}")


class ColumnParallelLinear(LinearBase):
    """Output features would be split across tensor-parallel ranks."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 quant_method: QuantMethod | None = None, tp_rank: int = 0, tp_size: int = 1):
        super().__init__(input_size, [output_size], bias, quant_method, tp_rank, tp_size)


class RowParallelLinear(LinearBase):
    """Input features would be split across ranks, the partial outputs all-reduced."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 quant_method: QuantMethod | None = None, tp_rank: int = 0, tp_size: int = 1):
        super().__init__(input_size, [output_size], bias, quant_method, tp_rank, tp_size)


class MergedLinear(LinearBase):
    """Several column-parallel matrices in one (gate_proj + up_proj).

    Shard i occupies output features [sum(output_sizes[:i]), sum(output_sizes[:i+1])).
    """

    def _shard_index(self, shard_id: object) -> int:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ModelLoadError(f"{type(self).__name__} has no shard {shard_id!r}")
        return shard_id

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: object = None) -> None:
        if shard_id is None:  # a checkpoint that stores the fused tensor
            copy_checked(param.data, loaded_weight)
            return
        i = self._shard_index(shard_id)
        dim = getattr(param, "output_dim", None)
        if dim is None:
            raise ModelLoadError(
                f"{type(self).__name__}: a parameter without output_dim cannot be loaded by shard")
        offset = sum(self.output_sizes[:i])
        copy_checked(param.data.narrow(dim, offset, self.output_sizes[i]), loaded_weight)


class QKVLinear(MergedLinear):
    """q, k and v projections in one matmul; shards "q", "k", "v".

    Output layout: [num_heads * head_dim | num_kv_heads * head_dim | num_kv_heads * head_dim].
    """
    _SHARDS = {"q": 0, "k": 1, "v": 2}

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, quant_method: QuantMethod | None = None,
                 tp_rank: int = 0, tp_size: int = 1):
        sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        super().__init__(hidden_size, sizes, bias, quant_method, tp_rank, tp_size)
        self.head_dim, self.num_heads, self.num_kv_heads = head_dim, num_heads, num_kv_heads

    def _shard_index(self, shard_id: object) -> int:
        if shard_id not in self._SHARDS:
            raise ModelLoadError(f"QKVLinear has no shard {shard_id!r}; expected q, k or v")
        return self._SHARDS[shard_id]

"""Linear layers and the `QuantMethod` hook that owns their weights.

A linear layer holds a `QuantMethod`, which creates the layer's weight
parameters, post-processes them once loaded (repacking, transposing) and runs
the product. Unquantized fp32/fp16/bf16 is just `UnquantizedLinearMethod`, so a
quantization scheme plugs in without touching the model.

Fused layers (`QKVLinear`, `MergedLinear`) stack several checkpoint matrices
along the output dimension so one matmul computes them all; their
`weight_loader` copies each checkpoint shard into its slice.

Tensor parallelism (`tp`, a `distributed.parallel.TPGroup` of size > 1): a
column-parallel layer holds its rank's slice of the output features of each
fused shard (q heads, the rank's KV heads, gate and up), a row-parallel one its
slice of the input features and sums the ranks' partial outputs with one
all-reduce. The loaders see whole checkpoint tensors; `weight_loader` copies
only the rank's slice, so no rank holds the whole matrix. Only unquantized
layers shard so far.

Parameter attributes the loaders read:
    output_dim: which dim of the parameter indexes output features (None: not per-output)
    input_dim: which dim indexes input features (None: not per-input)
    weight_loader: the loader `load_weights` calls for this parameter
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.distributed import comm
from slipstream.distributed.parallel import kv_heads_of_rank
from slipstream.errors import ModelLoadError
from slipstream.layers import decode_gemv, few_rows
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
        weight.output_dim, weight.input_dim = 0, 1
        layer.register_parameter("weight", weight)

    def process_after_loading(self, layer: nn.Module) -> None:
        pass

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        # one row (a batch-1 decode step), or a norm / SiLU left to this product:
        # the TMA GEMV on Hopper where it applies (layers/decode_gemv.py)
        if x.shape[0] == 1:
            y = decode_gemv.linear(layer, x)
            if y is not None:
                return y
            x = decode_gemv.unfold(x)
        elif few_rows.ROLES:    # a few rows of the products named (layers/few_rows.py)
            y = few_rows.linear(layer, x)
            if y is not None:
                return y
        return F.linear(x, layer.weight, layer.bias)


class LinearBase(nn.Module):
    """y = x W^T (+ b) through a QuantMethod; one checkpoint tensor per parameter.

    `input_size` and `output_sizes` are the whole layer's; a tensor-parallel
    rank holds `local_input_size` x `local_output_sizes`."""
    # "output": column-parallel, "input": row-parallel (set by the subclasses).
    split: str = "output"
    # Which product of a layer this is (qkv, o, gate_up, down; set by the model), for
    # choosing which take the batch-1 TMA GEMV (layers/decode_gemv.py).
    gemv_role: str | None = None

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 quant_method: QuantMethod | None = None, tp=None):
        super().__init__()
        self.tp = tp
        self.tp_rank, self.tp_size = (tp.rank, tp.size) if tp is not None else (0, 1)
        if (self.tp_size > 1 and not isinstance(quant_method, (type(None), UnquantizedLinearMethod))
                and not getattr(quant_method, "tp_shardable", False)):
            raise NotImplementedError(
                f"{type(quant_method).__name__}: these quantized linear layers are not sharded "
                "for tensor parallelism yet; use tensor_parallel_size=1")
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        self.output_size = sum(output_sizes)
        self.local_input_size = input_size
        if self.split == "input" and self.tp_size > 1:
            if input_size % self.tp_size:
                raise ValueError(f"tensor_parallel_size={self.tp_size} does not divide the "
                                 f"{input_size} input features of {type(self).__name__}")
            self.local_input_size = input_size // self.tp_size
        self.local_output_sizes = [self._rank_rows(i)[1] for i in range(len(self.output_sizes))]
        self.quant_method = quant_method or UnquantizedLinearMethod()
        params_dtype = torch.get_default_dtype()
        self.quant_method.create_weights(self, self.local_input_size, self.local_output_sizes,
                                         params_dtype)
        if bias:
            b = nn.Parameter(torch.empty(sum(self.local_output_sizes), dtype=params_dtype),
                             requires_grad=False)
            b.output_dim = 0
            self.register_parameter("bias", b)
        else:
            self.register_parameter("bias", None)
        # A quant method may attach its own loader to a parameter; the rest use the layer's.
        for p in self.parameters(recurse=False):
            if not hasattr(p, "weight_loader"):
                p.weight_loader = self.weight_loader

    def _rank_rows(self, i: int) -> tuple[int, int]:
        """(first row, row count) of fused shard i's checkpoint tensor this rank holds."""
        n = self.output_sizes[i]
        if self.split != "output" or self.tp_size == 1:
            return 0, n
        if n % self.tp_size:
            raise ValueError(f"tensor_parallel_size={self.tp_size} does not divide the {n} "
                             f"output features of {type(self).__name__}")
        n //= self.tp_size
        return self.tp_rank * n, n

    def whole_shape(self, param: nn.Parameter) -> tuple[int, ...]:
        """The shape of `param` in one process (what a checkpoint stores, fused)."""
        shape = list(param.shape)
        if self.tp_size > 1 and getattr(param, "output_dim", None) is not None:
            shape[param.output_dim] = self.output_size
        if self.tp_size > 1 and self.split == "input" and getattr(param, "input_dim", None) is not None:
            shape[param.input_dim] *= self.tp_size     # features, packed codes, groups alike
        return tuple(shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, local_input_size] -> [num_tokens, sum(local_output_sizes)]
        if not isinstance(self.quant_method, UnquantizedLinearMethod):
            x = decode_gemv.unfold(x)   # only the plain product folds a norm / SiLU in
        return self.quant_method.apply(self, x)

    def _load_shard(self, param: nn.Parameter, loaded: torch.Tensor, i: int) -> None:
        """Copy this rank's part of fused shard i (the whole checkpoint tensor) into `param`."""
        out_dim = getattr(param, "output_dim", None)
        in_dim = getattr(param, "input_dim", None)
        if self.tp_size > 1 and self.split == "input":
            if in_dim is None:
                if getattr(param, "tp_replicated", False):   # e.g. one scale per output row
                    copy_checked(param.data, loaded)
                elif self.tp_rank == 0:   # a row-parallel bias: added once, by rank 0
                    copy_checked(param.data, loaded)
                else:
                    copy_checked(param.data, torch.zeros_like(loaded))
                return
            # The rank's share along the input: features, packed codes or groups alike.
            n = param.shape[in_dim]
            if loaded.shape[in_dim] != n * self.tp_size:
                raise ModelLoadError(f"shape mismatch: checkpoint has {tuple(loaded.shape)}, "
                                     f"{self.tp_size} ranks expect {n} a rank along dim {in_dim}")
            copy_checked(param.data, loaded.narrow(in_dim, self.tp_rank * n, n))
            return
        if len(self.output_sizes) == 1 and self.tp_size == 1:
            copy_checked(param.data, loaded)
            return
        if out_dim is None:
            raise ModelLoadError(
                f"{type(self).__name__}: a parameter without output_dim cannot be loaded by shard")
        whole = list(param.shape)
        whole[out_dim] = self.output_sizes[i]   # (input features are whole here)
        if list(loaded.shape) != whole:
            raise ModelLoadError(f"shape mismatch: checkpoint has {tuple(loaded.shape)}, "
                                 f"model expects {tuple(whole)}")
        start, n = self._rank_rows(i)
        offset = sum(self.local_output_sizes[:i])
        copy_checked(param.data.narrow(out_dim, offset, n), loaded.narrow(out_dim, start, n))

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: object = None) -> None:
        if shard_id is not None:
            raise ModelLoadError(f"{type(self).__name__} has no shard {shard_id!r}")
        self._load_shard(param, loaded_weight, 0)

    def extra_repr(self) -> str:
        tp = f", tp={self.tp_rank}/{self.tp_size} ({self.split})" if self.tp_size > 1 else ""
        return (f"in={self.input_size}, out={self.output_sizes}, bias={self.bias is not None}, "
                f"quant={type(self.quant_method).__name__}{tp}")


class ColumnParallelLinear(LinearBase):
    """Output features split across tensor-parallel ranks (no communication)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 quant_method: QuantMethod | None = None, tp=None):
        super().__init__(input_size, [output_size], bias, quant_method, tp)


@dataclass(frozen=True)
class PartialSum:
    """A row-parallel output before the sum over ranks: this rank's [num_tokens,
    output_size] (fp32 or the model dtype), for an RMSNorm with `reduce` set."""
    partial: torch.Tensor


class RowParallelLinear(LinearBase):
    """Input features split across ranks; the partial outputs are summed by one all-reduce."""
    split = "input"
    # A fused all-reduce + RMSNorm (distributed/all_reduce_norm.py) that the norm
    # after this layer applies: steps of rows it `fits_rows` leave unreduced.
    defer_to = None

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 quant_method: QuantMethod | None = None, tp=None):
        super().__init__(input_size, [output_size], bias, quant_method, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor | PartialSum:
        # x: [num_tokens, input_size / tp] -> [num_tokens, output_size], summed over ranks
        if self.tp_size == 1:
            return LinearBase.forward(self, x)
        x = decode_gemv.unfold(x)
        fp32 = _fp32_partials(self, x)
        y = self._partial(x, fp32)
        if self.defer_to is not None and self.defer_to.fits_rows(y.shape[0]):
            return PartialSum(y)
        comm.all_reduce(y, self.tp.device_group)
        return y.to(x.dtype) if fp32 else y

    def _partial(self, x: torch.Tensor, fp32: bool) -> torch.Tensor:
        """This rank's share (bias on rank 0 only). fp32: partials leave the GEMM in
        fp32, rounded once after the sum as one GPU rounds its accumulator: TP=2
        then differs from TP=1 only in the order of fp32 additions."""
        if fp32:
            try:
                y = torch.mm(x, self.weight.t(), out_dtype=torch.float32)
            except (RuntimeError, TypeError):   # a torch without fp32-output mm
                _FP32_PARTIALS[0] = False
                return self._partial(x, False)
            if self.bias is not None:
                y += self.bias
            return y
        return self.quant_method.apply(self, x)


# Up to this many tokens a step, row-parallel layers sum fp32 partials: twice the
# all-reduce bytes, which cost nothing at decode; longer prefill steps keep bf16 sums.
FP32_PARTIALS_MAX_TOKENS = 256
_FP32_PARTIALS = [True]   # False once torch.mm(..., out_dtype=float32) is found missing


def _fp32_partials(layer: RowParallelLinear, x: torch.Tensor) -> bool:
    return (isinstance(layer.quant_method, UnquantizedLinearMethod) and _FP32_PARTIALS[0]
            and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and x.shape[0] <= FP32_PARTIALS_MAX_TOKENS)


class MergedLinear(LinearBase):
    """Several column-parallel matrices in one (gate_proj + up_proj).

    Shard i occupies local output features [sum(local_output_sizes[:i]), ...+local_output_sizes[i])
    (the whole output_sizes[i] at tensor_parallel_size 1).
    """

    def _shard_index(self, shard_id: object) -> int:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ModelLoadError(f"{type(self).__name__} has no shard {shard_id!r}")
        return shard_id

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: object = None) -> None:
        if shard_id is None:  # a checkpoint that stores the fused tensor
            if self.tp_size == 1:
                copy_checked(param.data, loaded_weight)
                return
            dim = getattr(param, "output_dim", 0)
            if loaded_weight.shape[dim] != self.output_size:
                raise ModelLoadError(f"shape mismatch: checkpoint has {tuple(loaded_weight.shape)}, "
                                     f"{type(self).__name__} has {self.output_size} rows")
            for i, n in enumerate(self.output_sizes):
                self._load_shard(param, loaded_weight.narrow(dim, sum(self.output_sizes[:i]), n), i)
            return
        self._load_shard(param, loaded_weight, self._shard_index(shard_id))


class QKVLinear(MergedLinear):
    """q, k and v projections in one matmul; shards "q", "k", "v".

    Output layout: [num_heads * head_dim | num_kv_heads * head_dim | num_kv_heads * head_dim],
    per rank: its num_heads / tp query heads and its KV heads (`kv_heads_of_rank`:
    split, or replicated when there are fewer KV heads than ranks).
    """
    _SHARDS = {"q": 0, "k": 1, "v": 2}

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, quant_method: QuantMethod | None = None, tp=None):
        self.head_dim, self.num_heads, self.num_kv_heads = head_dim, num_heads, num_kv_heads
        sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        super().__init__(hidden_size, sizes, bias, quant_method, tp)

    def _rank_rows(self, i: int) -> tuple[int, int]:
        if i == 0 or self.tp_size == 1:
            return super()._rank_rows(i)
        first, count = kv_heads_of_rank(self.num_kv_heads, self.tp_rank, self.tp_size)
        return first * self.head_dim, count * self.head_dim

    def _shard_index(self, shard_id: object) -> int:
        if shard_id not in self._SHARDS:
            raise ModelLoadError(f"QKVLinear has no shard {shard_id!r}; expected q, k or v")
        return self._SHARDS[shard_id]


def whole_row_range(layer: LinearBase, w: torch.Tensor) -> torch.Tensor | None:
    """For a row-parallel layer's local weight w [out, local_in] (tensor parallel):
    each row's largest and smallest value over the *whole* row, [out, 2], from
    one all-reduce; None elsewhere. A method that quantizes a whole row with one
    scale appends these two columns before quantizing and drops their codes, so
    every rank gets the scale (and zero) one process would compute."""
    if layer.split != "input" or layer.tp_size == 1:
        return None
    import torch.distributed as dist
    wf = w.float()
    both = torch.stack([wf.amax(1), -wf.amin(1)], dim=1)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=layer.tp.device_group)
    return torch.stack([both[:, 0], -both[:, 1]], dim=1).to(w.dtype)


def check_group_split(layer: LinearBase, group_size: int | None) -> None:
    """A row-parallel layer quantized in groups of `group_size` inputs splits only at
    group boundaries (or with one group spanning the whole row)."""
    if layer.split != "input" or layer.tp_size == 1 or group_size is None:
        return
    if group_size < layer.input_size and layer.local_input_size % group_size:
        raise ValueError(f"tensor_parallel_size={layer.tp_size}: quantization groups of "
                         f"{group_size} do not divide a rank's {layer.local_input_size} input "
                         f"features of {type(layer).__name__}")


def row_split_params(layer: LinearBase, per_input: list, per_row: list) -> None:
    """Mark a quantized layer's parameters for row-parallel loading: `per_input` are
    split along their dim 1 (codes, group scales), `per_row` (one value per output
    row) are loaded whole on every rank."""
    for p in per_input:
        p.input_dim = 1
    for p in per_row:
        p.tp_replicated = True


def quantize_whole_rows(layer: LinearBase, w: torch.Tensor, quantize_rows):
    """quantize_rows(w) -> (codes [out, in], per-row scales) on a layer's local weight,
    with each row's scale from the whole row's range under tensor parallelism
    (`whole_row_range` appended, its codes dropped): every rank gets one process's."""
    ext = whole_row_range(layer, w)
    codes, scales = quantize_rows(w if ext is None else torch.cat([w, ext], 1))
    return codes[:, :w.shape[1]].contiguous(), scales

"""GGUF weights at run time: the file's quantized blocks are the weights.

Scheme "gguf": on a CPU with the kernels of `kernels/cpu_quant.c` available,
every linear layer, the token embedding and the LM head keep the file's
Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K / Q6_K blocks (zero-copy views of the
memory-mapped file) and multiply through those kernels; tensors in other
formats, and every tensor on other devices, are dequantized at load and run
dense, as without a scheme.

`EngineArgs(quantization="auto")` (the default) becomes "gguf" where
`runs_quantized(model, device)` holds (a GGUF file on a CPU whose kernels
build), else no scheme; there `dtype=auto` becomes float32: activations are all
that the dtype still governs, and the kernels take fp32.

A fused layer's shards (q/k/v, gate/up) may come in different formats (a
Q4_K_M file stores some attn_v as Q6_K): each stays a segment of its own, one
kernel call covers them all.

Tensor parallel: a column-parallel rank keeps its rows of each shard's blocks,
a row-parallel one its columns where they start and end on block boundaries
(else that layer is dequantized on the rank); the embedding and LM head, which
split over the vocabulary, are dense.
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.errors import ModelLoadError
from slipstream.kernels import cpu_library, cpu_reference
from slipstream.kernels.cpu_quant import QUANTIZED, QuantMatrix
from slipstream.quant.base import register_scheme


def _is_gguf_path(model) -> bool:
    from slipstream.loader import is_gguf
    if model is None:
        return True     # the default model is a GGUF file
    path = Path(model).expanduser()
    return path.is_file() and is_gguf(path)


def runs_quantized(model, device: torch.device) -> bool:
    """Whether scheme "auto" keeps this model's GGUF blocks at run time."""
    return device.type == "cpu" and _is_gguf_path(model) and cpu_library.load() is not None


class GGUFLinearMethod:
    """QuantMethod over GGUF blocks; also serves embeddings (`embedding`)."""
    supports_embedding = True
    tp_shardable = True     # blocks sliced per rank (see the module docstring)
    dense_tables_under_tp = True

    def __init__(self, quantized: bool, dtype: torch.dtype):
        self.quantized = quantized     # kernels on the CPU (else dense at load)
        self.dtype = dtype

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        # The weight arrives shard by shard through the loader; it is assembled on first use.
        placeholder = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        placeholder.output_dim = None
        placeholder.weight_loader = functools.partial(self._load, layer)
        layer.register_parameter("weight", placeholder)
        layer.gguf_shards = [None] * len(output_sizes)
        layer.gguf_sizes = (input_size, list(output_sizes))
        layer.gguf_weight = None       # QuantMatrix, or a dense tensor

    def _load(self, layer: nn.Module, param: nn.Parameter, loaded, shard_id: object = None) -> None:
        cols, sizes = layer.gguf_sizes
        if getattr(layer, "tp_size", 1) > 1:   # the whole tensor arrives; the rank keeps its share
            cols, sizes = layer.input_size, layer.output_sizes
        if shard_id is None:
            index, rows = 0, sum(sizes)
            layer.gguf_shards = [None]
        else:
            index = layer._shard_index(shard_id)
            rows = sizes[index]
        shape = tuple(loaded.shape)
        if shape != (rows, cols):
            raise ModelLoadError(f"shape mismatch: checkpoint has {shape}, model expects {(rows, cols)}")
        if getattr(layer, "tp_size", 1) > 1:
            loaded = _rank_share(layer, loaded, index)
        layer.gguf_shards[index] = loaded
        layer.gguf_weight = None
        if all(s is not None for s in layer.gguf_shards):
            self._assemble(layer)   # an embedding gets no process_after_loading call

    def process_after_loading(self, layer: nn.Module) -> None:
        if layer.gguf_weight is None:
            self._assemble(layer)

    def _assemble(self, layer: nn.Module):
        shards = layer.gguf_shards
        if any(s is None for s in shards):
            raise ModelLoadError(f"{type(layer).__name__}: a weight shard was never loaded")
        cols = layer.gguf_sizes[0]
        quantized = [not isinstance(s, torch.Tensor) for s in shards]
        if self.quantized and all(quantized):
            layer.gguf_weight = QuantMatrix([(s.qtype, s.data) for s in shards], cols)
        else:   # dense: dequantize what is still in blocks
            parts = [cpu_reference.dequantize(s.qtype, s.data, cols) if q else s
                     for s, q in zip(shards, quantized)]
            w = torch.cat([p.to(self.dtype) for p in parts])
            layer.gguf_weight = w.to(layer.weight.device)
        layer.gguf_shards = [None] * len(shards) if self.quantized and all(quantized) else shards
        return layer.gguf_weight

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, input_size] -> [num_tokens, output_size]
        w = layer.gguf_weight if layer.gguf_weight is not None else self._assemble(layer)
        bias = getattr(layer, "bias", None)
        if isinstance(w, torch.Tensor):
            return F.linear(x, w, bias)
        y = w.matmul(x if x.dtype == torch.float32 else x.float())
        if bias is not None:
            y += bias
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        # ids: [num_tokens] int64 -> [num_tokens, hidden] in the model dtype
        w = layer.gguf_weight if layer.gguf_weight is not None else self._assemble(layer)
        if isinstance(w, torch.Tensor):
            return F.embedding(ids, w)
        return w.get_rows(ids).to(self.dtype)


def _rank_share(layer: nn.Module, w, index: int):
    """A tensor-parallel rank's part of fused shard `index` (GGUFWeight blocks or a
    dense tensor, whole): its rows of a column-parallel layer, its columns of a
    row-parallel one (blocks when the columns start and end on block boundaries,
    else dequantized)."""
    from slipstream.loader.gguf import GGUFWeight
    from slipstream.kernels.cpu_quant import BLOCKS
    rank = layer.tp_rank
    if layer.split == "output":
        n = layer.local_output_sizes[index]
        if isinstance(w, torch.Tensor):
            return w[rank * n:(rank + 1) * n]
        return GGUFWeight(w.qtype, w.data[rank * n:(rank + 1) * n], (n, w.shape[1]))
    n = layer.local_input_size
    if not isinstance(w, torch.Tensor):
        per_block, block_bytes = BLOCKS[w.qtype]
        if n % per_block == 0:
            b = n // per_block * block_bytes
            return GGUFWeight(w.qtype, w.data[:, rank * b:(rank + 1) * b], (w.shape[0], n))
        w = cpu_reference.dequantize(w.qtype, w.data, w.shape[1])
    return w[:, rank * n:(rank + 1) * n]


def _keep(hf_name: str, qtype: int) -> bool:
    return qtype in QUANTIZED


@register_scheme("gguf")
def gguf_scheme(config, files):
    from slipstream.loader.gguf import GGUFModelFiles
    if not isinstance(files, GGUFModelFiles):
        raise ValueError("quantization: 'gguf' runs GGUF files; the model is not one")
    quantized = config.device.type == "cpu" and cpu_library.load() is not None
    if quantized:
        # Under tensor parallelism the tables split over the vocabulary, densely.
        tables = ("model.embed_tokens.", "lm_head.")
        tp = config.parallel.tensor_parallel_size > 1
        files.keep_quantized(lambda name, q: _keep(name, q) and not (tp and name.startswith(tables)))
        cpu_library.take_threads(config)
    method = GGUFLinearMethod(quantized, config.dtype)
    return lambda prefix: method

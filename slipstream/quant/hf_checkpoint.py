"""GPTQ and AWQ checkpoints in the common Hugging Face layouts (GPTQModel / AutoGPTQ,
AutoAWQ "gemm"), converted at load into IntWeightMethod's layout.

GPTQ (config quantization_config {"quant_method": "gptq", "bits", "group_size",
"desc_act", "sym", "checkpoint_format": "gptq" | "gptq_v2"}), per linear layer:
    qweight  int32 [K / (32 / bits), N]  input k at bits (k % pf) * bits of row k // pf
    qzeros   int32 [groups, N / pf]      output n at bits (n % pf) * bits; v1 stores zero - 1
    scales   fp16  [groups, N]
    g_idx    int32 [K]                   group of each input (act-order: not k // group)
AWQ ("quant_method": "awq", "version": "gemm", "zero_point": true), 4 bits:
    qweight  int32 [K, N / 8]   packed along N; slot i of word j holds n = 8j + (0,2,4,6,1,3,5,7)[i]
    qzeros   int32 [groups, N / 8] same packing (zero stored as is)
    scales   fp16  [groups, N]

The dequantized weight is w[n, k] = scales[g(k), n] * (q[k, n] - zero[g(k), n]).
With act-order (g_idx not k // group), the inputs are sorted by group so that each
group is contiguous: the layer then computes x[:, perm] @ W[:, perm]^T (perm stored).
"""
from __future__ import annotations

import torch
from torch import nn

from slipstream.errors import ModelLoadError
from slipstream.layers.weight_loader import copy_checked
from slipstream.quant.base import register_scheme
from slipstream.quant.int_weight import IntWeightMethod, set_quantized

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> values along `dim` (value i of a word at bits i * bits), int16."""
    pf = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    p = packed.to(torch.int32).movedim(dim, -1)
    vals = (p[..., None] >> shifts) & (2 ** bits - 1)            # [..., words, pf]
    assert vals.shape[-1] == pf
    return vals.flatten(-2).movedim(-1, dim).to(torch.int16)


def awq_unorder(vals: torch.Tensor) -> torch.Tensor:
    """Undo AWQ's interleaving along the last dim (groups of 8)."""
    reverse = [AWQ_ORDER.index(j) for j in range(8)]
    n = vals.shape[-1]
    idx = (torch.arange(n, device=vals.device).view(-1, 8)[:, reverse]).reshape(-1)
    return vals[..., idx]


def _param(t: torch.Tensor, output_dim: int | None) -> nn.Parameter:
    p = nn.Parameter(t, requires_grad=False)
    p.output_dim = output_dim
    return p


def _row_split(layer: nn.Module) -> bool:
    return getattr(layer, "tp_size", 1) > 1 and getattr(layer, "split", None) == "input"


def _input_share(layer: nn.Module, param: nn.Parameter, loaded: torch.Tensor) -> torch.Tensor:
    """A row-parallel rank's share of a tensor stored along the input in dim 0 (packed
    codes, groups or inputs alike): its param's length, at its rank's offset."""
    if getattr(param, "tp_replicated", False):     # one group spans the whole row
        return loaded
    n = param.shape[0]
    if loaded.shape[0] != n * layer.tp_size:
        raise ModelLoadError(f"shape mismatch: checkpoint has {tuple(loaded.shape)}, "
                             f"{layer.tp_size} ranks expect {n} rows each")
    return loaded.narrow(0, layer.tp_rank * n, n)


def _loader(layer: nn.Module, dim: int | None, pack: int):
    """Copies a shard of a fused layer into its slice; `pack` output features per stored
    column (the slice offset and size shrink by it). Tensor parallel: a column-parallel
    rank takes its share of each shard's outputs, a row-parallel one its share of the
    inputs (dim 0 of every GPTQ / AWQ tensor)."""
    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if _row_split(layer):
            copy_checked(param.data, _input_share(layer, param, loaded))
            return
        if dim is None or (shard_id is None and getattr(layer, "tp_size", 1) == 1):
            copy_checked(param.data, loaded)
            return
        i = 0 if shard_id is None else layer._shard_index(shard_id)
        off, size = sum(layer.local_output_sizes[:i]), layer.local_output_sizes[i]
        start = getattr(layer, "tp_rank", 0) * size          # within the shard
        if off % pack or size % pack:
            raise ModelLoadError(f"shard {shard_id!r}: {size} outputs do not pack by {pack}")
        copy_checked(param.data.narrow(dim, off // pack, size // pack),
                     loaded.narrow(dim, start // pack, size // pack))
    return load


def _shared_loader(layer: nn.Module):
    """g_idx is one per input, so every shard of a fused layer (q, k, v read the same
    input, hence the same act-order) must store the same one. A row-parallel rank
    keeps its inputs' entries, renumbered from its first group."""
    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if _row_split(layer):
            loaded = _input_share(layer, param, loaded)
            loaded = loaded - loaded.min()
        if getattr(layer, "_g_idx_loaded", False) and not torch.equal(
                param.data, loaded.to(param.dtype)):
            raise ModelLoadError("g_idx differs between the shards of a fused layer")
        copy_checked(param.data, loaded)
        layer._g_idx_loaded = True
    return load


class HFPackedIntMethod:
    """Loads GPTQ/AWQ tensors as stored, converts them once loaded, then runs as
    IntWeightMethod (Triton int4/int8 kernel on CUDA, reference elsewhere)."""

    def __init__(self, fmt: str, bits: int, group_size: int, v1_zeros: bool = True):
        if fmt not in ("gptq", "awq"):
            raise ValueError(f"quantization_config: unknown format {fmt!r}")
        if bits not in (2, 4, 8) or (fmt == "awq" and bits != 4):
            raise ValueError(f"quantization_config: {fmt} with {bits} bits is not supported")
        self.fmt, self.bits, self.group_size, self.v1_zeros = fmt, bits, group_size, v1_zeros
        self.inner = IntWeightMethod(bits, group_size, sym=False, prequantized=True)
        self.tp_shardable = True   # act-order layers refused along their input (below)

    def create_weights(self, layer, input_size, output_sizes, params_dtype) -> None:
        n, k = sum(output_sizes), input_size
        pf = 32 // self.bits
        group = k if self.group_size in (-1, None) else self.group_size
        groups = -(-k // group)
        layer.hf_group = group
        i32 = torch.int32
        if self.fmt == "gptq":
            qw = _param(torch.empty(k // pf, n, dtype=i32), 1)
            qw.weight_loader = _loader(layer, 1, 1)
            g_idx = _param(torch.empty(k, dtype=i32), None)
            g_idx.weight_loader = _shared_loader(layer)
            layer.register_parameter("g_idx", g_idx)
        else:
            qw = _param(torch.empty(k, n // pf, dtype=i32), 1)
            qw.weight_loader = _loader(layer, 1, pf)
        qz = _param(torch.empty(groups, n // pf, dtype=i32), 1)
        qz.weight_loader = _loader(layer, 1, pf)
        sc = _param(torch.empty(groups, n, dtype=torch.float16), 1)
        sc.weight_loader = _loader(layer, 1, 1)
        for name, p in (("qweight", qw), ("qzeros", qz), ("scales", sc)):
            layer.register_parameter(name, p)
        if _row_split(layer):
            from slipstream.layers.linear import check_group_split
            whole_row = self.group_size in (-1, None)
            check_group_split(layer, None if whole_row else self.group_size)
            if whole_row:          # one group a row: its scales and zeros on every rank
                qz.tp_replicated = sc.tp_replicated = True

    def process_after_loading(self, layer) -> None:
        bits, group = self.bits, layer.hf_group
        if self.fmt == "gptq":
            q = unpack_int32(layer.qweight.data, bits, dim=0)           # [K, N]
            z = unpack_int32(layer.qzeros.data, bits, dim=1)            # [G, N]
            if self.v1_zeros:
                z = (z + 1) & (2 ** bits - 1)   # v1 stores zero - 1, modulo 2^bits
            g_idx = layer.g_idx.data.long()
        else:
            q = awq_unorder(unpack_int32(layer.qweight.data, bits, dim=1))
            z = awq_unorder(unpack_int32(layer.qzeros.data, bits, dim=1))
            g_idx = torch.arange(q.shape[0], device=q.device) // group
        k = q.shape[0]
        scales = layer.scales.data.float()                               # [G, N]
        perm = None
        if not torch.equal(g_idx, torch.arange(k, device=g_idx.device) // group):
            if _row_split(layer):
                raise ModelLoadError(f"tensor_parallel_size={layer.tp_size}: an act-order "
                                     f"(desc_act) layer permutes its whole input; it does not "
                                     f"split along it")
            perm = torch.argsort(g_idx, stable=True)
            counts = torch.bincount(g_idx, minlength=scales.shape[0])
            if (counts[:-1] != group).any():
                raise ModelLoadError("g_idx: groups of unequal size cannot be reordered")
            q = q[perm]
        codes = q.t().contiguous().to(torch.uint8)                      # [N, K]
        if z.max() > 2 ** bits - 1 or z.min() < 0:
            raise ModelLoadError("qzeros: zero points out of range for the bit width")
        for name in ("qweight", "qzeros", "scales", "g_idx"):
            if hasattr(layer, name):
                delattr(layer, name)
        layer.group_cols = group
        set_quantized(layer, codes, scales.t().contiguous(), z.t().contiguous(), bits, False,
                      codes.device, perm)
        self.inner._cpu_blocks(layer)      # on the CPU: GGUF blocks for its kernels

    def apply(self, layer, x):
        return self.inner.apply(layer, x)


def _scheme(fmt: str):
    def factory(config, files):
        qc = getattr(files, "quantization_config", None)
        if not qc or str(qc.get("quant_method", fmt)).lower() != fmt:
            found = (qc or {}).get("quant_method")
            raise ValueError(f"quantization {fmt!r} reads {fmt.upper()} checkpoints; this model "
                             + (f"is quantized with {found!r}" if found else
                                "has no quantization_config") + " (quantize one with "
                             f"`slipstream quantize --method {fmt}`, or leave --quantization at auto)")
        bits = int(qc.get("bits", 4))
        group = int(qc.get("group_size", 128))
        if fmt == "awq" and str(qc.get("version", "gemm")).lower() != "gemm":
            raise ValueError(f"quantization_config: AWQ version {qc.get('version')!r}; "
                             "only the gemm layout is read")
        if fmt == "awq" and not qc.get("zero_point", True):
            raise ValueError("quantization_config: AWQ without zero points is not supported")
        v1 = qc.get("checkpoint_format", "gptq") != "gptq_v2"
        # Layers a checkpoint keeps unquantized (e.g. lm_head) are dense in the model anyway.
        return lambda prefix: HFPackedIntMethod(fmt, bits, group, v1)
    return factory


register_scheme("gptq")(_scheme("gptq"))
register_scheme("awq")(_scheme("awq"))

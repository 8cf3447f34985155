"""Weight-only integer linear method (w4a16, w3a16, w8a16): packed codes, per-group
scales and zero points; activations stay in the model dtype.

Layer parameters (all with output_dim 0, so fused q/k/v and gate/up shards load into
their row slices):
    qweight  uint8 [out, packed_cols(in)]   codes, two per byte for 3/4 bits (pack_codes); on
                                            CUDA replaced by `qwords` on the first product
    scales   fp32  [out, ceil(in / group)]
    qzeros   uint8 [out, ceil(in / group)]       asymmetric only (symmetric: zero = 2^(bits-1))
    perm     int32 [in]                     act-order only: the layer computes x[:, perm] @ W'^T,
                                            W' holding the input columns in quantization order

`prequantized=False` registers a dense `weight` that the float checkpoint loads into,
then quantizes it by RTN in `process_after_loading`. On CUDA 4- and 8-bit layers run
Triton kernels (kernels/int_weight_gemv.py at decode batch sizes, kernels/quant_gemm.py
above), reading the codes in the tiled word layout where a tile divides the row, else the
packed codes; 4-bit layers in groups of 128 on sm_80+ run the tensor-core kernels of
kernels/w4_mma_gemv.py (the GEMV up to 64 rows, on sm_90 the warpgroup kernel up to 128,
or the weight dequantized for cuBLAS where the tuner finds that faster, and always
above). On the CPU, 4-bit and symmetric 8-bit layers whose groups are whole 32-column
blocks run the GGUF kernels on the same weights as Q4_1 / Q8_0 blocks (quant/cpu_blocks.py;
activations rounded to int8 per block, as for GGUF files; SLIPSTREAM_CPU_BLOCKS=0 keeps
the exact products). Elsewhere, and for 2/3 bits, the plain-PyTorch twin dequantizes and
multiplies.
"""
from __future__ import annotations

import os

import torch
from torch import nn

from slipstream.kernels import reference
from slipstream.layers.weight_loader import copy_checked
from slipstream.quant import cpu_blocks
from slipstream.quant.primitives import check_bits, pack_codes, packed_cols


def layer_group_cols(input_size: int, group_size: int | None) -> int:
    """Columns per group for a layer: a layer no wider than the group has one group per row;
    when group_size does not divide the width, the last group of each row is narrower."""
    if group_size is not None and group_size <= 0:
        raise ValueError(f"group_size: expected a positive number or None, got {group_size}")
    if group_size is None or group_size >= input_size:
        return input_size
    return group_size


def _param(t: torch.Tensor, output_dim: int | None = 0) -> nn.Parameter:
    p = nn.Parameter(t, requires_grad=False)
    p.output_dim = output_dim
    return p


def _same_for_every_shard(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    # The input permutation is one per fused layer: every shard stores the same one.
    copy_checked(param.data, loaded)


class IntWeightMethod:
    def __init__(self, bits: int, group_size: int | None = 128, sym: bool = False,
                 act_order: bool = False, prequantized: bool = False):
        check_bits(bits)
        self.bits, self.group_size, self.sym = bits, group_size, sym
        self.act_order, self.prequantized = act_order, prequantized
        # Tensor parallel: a rank loads its shard (dense, then quantized with the codes one
        # process would: groups aligned with the split, whole-row scales from the row's
        # global range; or the checkpoint's codes and scales). Act-order layers split
        # only along their outputs.
        self.tp_shardable = True

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        out = sum(output_sizes)
        layer.group_cols = layer_group_cols(input_size, self.group_size)
        row_split = getattr(layer, "tp_size", 1) > 1 and getattr(layer, "split", None) == "input"
        if row_split:
            from slipstream.layers.linear import check_group_split
            check_group_split(layer, self.group_size)
            if self.act_order and self.prequantized:
                raise ValueError(f"tensor_parallel_size={layer.tp_size}: an act-order layer "
                                 f"({type(layer).__name__}) permutes its whole input; it does "
                                 f"not split along it")
        if not self.prequantized:
            w = _param(torch.empty(out, input_size, dtype=params_dtype))
            w.input_dim = 1
            layer.register_parameter("weight", w)
            return
        self._register_quantized(layer, out, input_size)
        if row_split:
            from slipstream.layers.linear import row_split_params
            grouped = [layer.scales] + ([layer.qzeros] if not self.sym else [])
            whole_row = self.group_size is None or self.group_size >= layer.input_size
            row_split_params(layer, [layer.qweight] + ([] if whole_row else grouped),
                             grouped if whole_row else [])
        if self.act_order:
            perm = _param(torch.empty(input_size, dtype=torch.int32), None)
            perm.weight_loader = _same_for_every_shard
            layer.register_parameter("perm", perm)

    def _register_quantized(self, layer: nn.Module, out: int, input_size: int) -> None:
        groups = -(-input_size // layer.group_cols)
        layer.register_parameter("qweight", _param(torch.empty(
            out, packed_cols(input_size, self.bits), dtype=torch.uint8)))
        layer.register_parameter("scales", _param(torch.empty(out, groups, dtype=torch.float32)))
        if not self.sym:
            layer.register_parameter("qzeros", _param(torch.empty(out, groups, dtype=torch.uint8)))

    def process_after_loading(self, layer: nn.Module) -> None:
        if not self.prequantized:
            from slipstream.layers.linear import whole_row_range
            from slipstream.quant.rtn import rtn_quantize
            w = layer.weight.data
            # One group spanning the whole (unsplit) row: its range over every rank's part.
            whole_row = self.group_size is None or self.group_size >= layer.input_size
            ext = whole_row_range(layer, w) if whole_row else None
            if ext is None:
                qt = rtn_quantize(w.float(), self.bits, layer.group_cols, self.sym)
                codes = qt.codes
            else:   # one group a row: its range over the whole row, as one process
                qt = rtn_quantize(torch.cat([w, ext], 1).float(), self.bits, w.shape[1] + 2,
                                  self.sym)
                codes = qt.codes[:, :w.shape[1]].contiguous()
            del layer.weight
            set_quantized(layer, codes, qt.scale, qt.zero, self.bits, self.sym, w.device)
        self._cpu_blocks(layer)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, in] -> [num_tokens, out]
        if getattr(layer, "perm", None) is not None:
            x = x.index_select(1, layer.perm)        # int32 indices: no conversion kernel
        blocks = getattr(layer, "cpu_blocks", None)
        if blocks is not None and not x.is_cuda:
            y = blocks.matmul(x if x.dtype == torch.float32 else x.float()).to(x.dtype)
            return y if layer.bias is None else y + layer.bias
        packed = self._gpu_mma(layer, x)
        if packed is not None:
            from slipstream.kernels.quant_gemm import w4_mma_product
            y = w4_mma_product(x, packed)
            return y if layer.bias is None else y + layer.bias
        zeros = layer.qzeros if not self.sym else None
        tile = self._gpu_tile(layer, x)
        if tile is not None:
            from slipstream.kernels.quant_gemm import tiled_int_weight_gemm
            from slipstream.kernels.tma_gemv import descriptors_of
            y = tiled_int_weight_gemm(x, layer.qwords, layer.scales, zeros, self.bits,
                                      layer.group_cols, tile, descriptors_of(layer))
        elif x.is_cuda and self.bits in (4, 8):
            from slipstream.kernels.quant_gemm import int_weight_gemm
            y = int_weight_gemm(x, layer.qweight, layer.scales, zeros, self.bits, layer.group_cols)
        else:
            y = reference.int_weight_linear(x, layer.qweight, layer.scales, zeros, self.bits,
                                            layer.group_cols)
        return y if layer.bias is None else y + layer.bias


    def _cpu_blocks(self, layer: nn.Module) -> None:
        """On the CPU, 4-bit and symmetric 8-bit codes in groups of whole 32-column blocks
        become GGUF blocks for the CPU kernels (quant/cpu_blocks.py: Q4_1 / Q8_0, the
        scales rounded to fp16, activations quantized to int8 per block in the products),
        held in `layer.cpu_blocks` in place of `qweight`, `scales` and `qzeros`; without an
        input permutation also as `gguf_weight`, which the one-call decode step
        (kernels/cpu_decoder.py) reads. Elsewhere (a GPU,
        no C compiler, SLIPSTREAM_CPU_BLOCKS=0, other formats) the layer keeps its path."""
        q = getattr(layer, "qweight", None)
        if q is None or q.device.type != "cpu" or not cpu_blocks.enabled():
            return
        from slipstream.kernels import cpu_library
        from slipstream.kernels.cpu_quant import QuantMatrix
        from slipstream.quant.primitives import unpack_codes
        codes = unpack_codes(q.data, self.bits)
        if (not cpu_blocks.representable(self.bits, self.sym, codes.shape[1], layer.group_cols)
                or cpu_library.load() is None):
            return
        zeros = None if self.sym else layer.qzeros.data
        data = cpu_blocks.to_gguf_blocks(codes, layer.scales.data, zeros, self.bits,
                                         layer.group_cols)
        layer.cpu_blocks = QuantMatrix([data], codes.shape[1])
        if getattr(layer, "perm", None) is None:
            layer.gguf_weight = layer.cpu_blocks
        del layer.qweight, layer.scales        # the blocks hold them (as the GPU paths do)
        if not self.sym:
            del layer.qzeros
        cpu_library.take_threads(layer)     # the kernels carry the products (as for GGUF)

    def _gpu_mma(self, layer: nn.Module, x: torch.Tensor):
        """On a CUDA GPU with tensor cores (sm_80+), 4-bit codes in groups of 128 re-laid
        out on the first product for the tensor-core GEMV (kernels/w4_mma_gemv.py):
        `qweight`, `scales` and `qzeros` give way to `qwords_mma` and a W4Mma in
        `layer.w4_mma` (which holds the scales and zeros transposed). None: another path
        (SLIPSTREAM_W4_MMA=0 turns this one off)."""
        packed = getattr(layer, "w4_mma", None)
        if packed is not None or not x.is_cuda or getattr(layer, "w4_mma_checked", False):
            return packed
        layer.w4_mma_checked = True
        from slipstream.kernels import w4_mma_gemv as w4
        if (self.bits != 4 or layer.group_cols != w4.GROUP or x.shape[1] % w4.GROUP
                or not w4.HAVE_GLUON or getattr(layer, "qweight", None) is None
                or x.dtype not in (torch.bfloat16, torch.float16)
                or torch.cuda.get_device_capability(x.device) < (8, 0)
                or os.environ.get("SLIPSTREAM_W4_MMA", "1") in ("", "0")):
            return None
        _check_not_capturing()
        from slipstream.quant.primitives import unpack_codes
        q = layer.qweight.data
        zeros = None if self.sym else layer.qzeros.data
        parts = [w4.pack_w4_mma(unpack_codes(q[i:i + 4096], 4), layer.scales.data[i:i + 4096],
                                None if zeros is None else zeros[i:i + 4096])
                 for i in range(0, q.shape[0], 4096)]       # 4096: whole 64-row blocks
        packed = w4.W4Mma(torch.cat([p.words for p in parts]),
                          torch.cat([p.scales for p in parts], 1),
                          torch.cat([p.zeros for p in parts], 1), q.shape[0], x.shape[1])
        del layer.qweight, layer.scales, q, parts
        if zeros is not None:
            del layer.qzeros, zeros
        layer.register_parameter("qwords_mma", _param(packed.words))
        layer.w4_mma = packed
        return packed

    def _gpu_tile(self, layer: nn.Module, x: torch.Tensor) -> int | None:
        """On CUDA, the tile of the GPU word layout (kernels/int_weight_gemv.py), the codes
        re-laid out on the first product (an eager warm-up run): `qweight` gives way to
        `qwords`, the same codes in the order the weight-streaming kernels read. None: the
        packed codes stay (CPU, 2/3 bits, or a width no tile divides)."""
        tile = getattr(layer, "gpu_tile", None)
        if tile is not None or not x.is_cuda:
            return tile or None
        from slipstream.kernels.int_weight_gemv import pick_tile, tile_codes
        from slipstream.quant.primitives import unpack_codes
        tile = pick_tile(x.shape[1], layer.group_cols, self.bits)
        if tile is None or getattr(layer, "qweight", None) is None:
            layer.gpu_tile = 0
            return None
        _check_not_capturing()
        q = layer.qweight.data
        words = torch.cat([tile_codes(unpack_codes(q[i:i + 4096], self.bits), self.bits, tile)
                           for i in range(0, q.shape[0], 4096)])
        del layer.qweight, q
        layer.register_parameter("qwords", _param(words))
        layer.gpu_tile = tile
        return tile


def _check_not_capturing() -> None:
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("a weight-only quantized layer must run once eagerly before a "
                           "CUDA graph capture (its codes are re-laid out on the first product)")


def set_quantized(layer: nn.Module, codes: torch.Tensor, scale: torch.Tensor,
                  zero: torch.Tensor, bits: int, sym: bool, device,
                  perm: torch.Tensor | None = None) -> None:
    """Install quantized weights (codes uint8 [out, in], scale/zero [out, groups]) on a layer."""
    layer.register_parameter("qweight", _param(pack_codes(codes, bits).to(device)))
    layer.register_parameter("scales", _param(scale.float().to(device)))
    if not sym:
        layer.register_parameter("qzeros", _param(zero.to(torch.uint8).to(device)))
    if perm is not None:
        layer.register_parameter("perm", _param(perm.to(torch.int32).to(device), None))


class IntWeightHeadMethod(IntWeightMethod):
    """The weight-only method for the LM head (an untied one: a tied head is the embedding
    table and stays as it is). The head is not a linear layer the loaders post-process, so
    its dense weight is quantized on the first product, which the engine's warm-up (memory
    profiling) runs eagerly; it is quantized in chunks of rows to keep the temporaries
    small. Embedding lookups are not served."""
    supports_embedding = True      # lets the model hand it the LM head's table

    CHUNK_ROWS = 8192

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if not any(hasattr(layer, n) for n in ("qweight", "qwords", "qwords_mma", "cpu_blocks")):
            if x.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("the LM head must run once eagerly before a CUDA graph "
                                   "capture (it is quantized on its first product)")
            self._quantize_head(layer)
            self._cpu_blocks(layer)
        return super().apply(layer, x)

    def _quantize_head(self, layer: nn.Module) -> None:
        from slipstream.quant.rtn import rtn_quantize
        w = layer.weight.data
        parts = [rtn_quantize(w[i:i + self.CHUNK_ROWS].float(), self.bits, layer.group_cols,
                              self.sym) for i in range(0, w.shape[0], self.CHUNK_ROWS)]
        del layer.weight
        set_quantized(layer, torch.cat([p.codes for p in parts]),
                      torch.cat([p.scale for p in parts]), torch.cat([p.zero for p in parts]),
                      self.bits, self.sym, w.device)

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        raise ValueError("quantization: this scheme quantizes the LM head, not the embedding")

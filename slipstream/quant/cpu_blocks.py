"""Weight-only integer codes as GGUF blocks, so the CPU kernels run them.

A 4-bit layer quantized in groups (RTN, GPTQ, AWQ; w = (code - zero) x scale with one
scale and zero per row and group) is, block of 32 by block of 32, exactly a Q4_1 block
(w = d x code + m) with d = scale and m = -zero x scale; a symmetric 8-bit layer
(zero 128) is a Q8_0 block (w = d x q) with q = code - 128 and d = scale. The only
change to the weights is d and m rounded to fp16 (GGUF's block fields). The kernels
then multiply as they do for a GGUF file, with the activations quantized to int8 per
block of 32 (llama.cpp's scheme), instead of dequantizing the whole weight for every
product in PyTorch.

    data = to_gguf_blocks(codes, scales, zeros, bits, group_cols)   # None: not representable
    qm = QuantMatrix([data], cols)                                    # kernels/cpu_quant.py
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

Q4_1, Q8_0 = 3, 8      # ggml type ids
BLOCK = 32


# Schemes whose layers are weight-only integer codes (at load, or in a checkpoint's
# quantization_config) that may take the blocks.
SCHEMES = ("rtn-int4", "rtn-int4-head8", "int8", "int8-head8", "slipstream", "gptq", "awq")


def enabled() -> bool:
    """SLIPSTREAM_CPU_BLOCKS=0 keeps the exact products in PyTorch."""
    return os.environ.get("SLIPSTREAM_CPU_BLOCKS", "1") not in ("", "0")


def runs_on_blocks(model_path, quantization: str | None, device) -> bool:
    """Whether a model's weight-only layers will run on the CPU kernels' blocks, so that
    `dtype=auto` becomes float32 (the kernels and the one-call decode step take fp32
    activations; in bf16 every product converts, and the one-call step is off)."""
    from slipstream.kernels import cpu_library
    if device.type != "cpu" or not enabled():
        return False
    scheme = quantization
    config = Path(str(model_path)) / "config.json"
    if scheme is None and config.is_file():
        scheme = (json.loads(config.read_text()).get("quantization_config") or {}).get(
            "quant_method")
    return scheme in SCHEMES and cpu_library.load() is not None


def representable(bits: int, sym: bool, cols: int, group_cols: int) -> bool:
    """Whether a layer's codes map onto GGUF blocks: 4 bits, or 8 bits symmetric, with
    groups (and rows) of whole 32-column blocks."""
    return ((bits == 4 or (bits == 8 and sym)) and cols % BLOCK == 0
            and group_cols % BLOCK == 0)


def to_gguf_blocks(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                   bits: int, group_cols: int) -> tuple[int, torch.Tensor] | None:
    """codes uint8 [rows, cols] (unpacked, < 2^bits), scales fp32 [rows, groups], zeros
    uint8 [rows, groups] or None (symmetric: 2^(bits-1)) -> (ggml type, uint8 [rows,
    cols / 32 x block bytes]); None when `representable` says no."""
    rows, cols = codes.shape
    if not representable(bits, zeros is None, cols, group_cols):
        return None
    per_group = group_cols // BLOCK
    d = scales.float().repeat_interleave(per_group, 1)[:, :cols // BLOCK]      # [rows, blocks]
    q = codes.reshape(rows, cols // BLOCK, BLOCK)
    d16 = d.to(torch.float16).view(torch.uint8).reshape(rows, -1, 2)
    if bits == 8:
        qs = (q.to(torch.int16) - 128).to(torch.int8).view(torch.uint8)
        return Q8_0, torch.cat([d16, qs], 2).reshape(rows, -1).contiguous()
    z = (torch.full_like(scales, 8.0) if zeros is None else zeros.float())
    m = (-z.repeat_interleave(per_group, 1)[:, :cols // BLOCK] * d).to(torch.float16)
    m16 = m.view(torch.uint8).reshape(rows, -1, 2)
    qs = (q[..., :BLOCK // 2] | (q[..., BLOCK // 2:] << 4)).to(torch.uint8)     # j | j + 16
    return Q4_1, torch.cat([d16, m16, qs], 2).reshape(rows, -1).contiguous()

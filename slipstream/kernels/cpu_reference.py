"""Plain twins of the CPU kernels (`cpu_quant.py`, `cpu_attention.py`).

Dequantization is the `gguf` package's numpy code (llama.cpp's own Python
reference), so the C kernels are checked against an implementation written
independently of them. These are also the pure-torch path when no C compiler
is present: weights are then dequantized once at load.
"""
from __future__ import annotations

import gguf
import numpy as np
import torch

from slipstream.kernels import reference


def dequantize(qtype: int, data: torch.Tensor, cols: int) -> torch.Tensor:
    """data: uint8 [rows, row_bytes] of ggml type `qtype` -> fp32 [rows, cols]."""
    arr = data.numpy() if data.dtype == torch.uint8 else data.view(torch.uint8).numpy()
    out = gguf.quants.dequantize(np.ascontiguousarray(arr), gguf.GGMLQuantizationType(qtype))
    return torch.from_numpy(np.asarray(out, dtype=np.float32).reshape(data.shape[0], cols))


def quant_matmul(segments: list[tuple[int, torch.Tensor]], cols: int, x: torch.Tensor) -> torch.Tensor:
    """Twin of `QuantMatrix.matmul`: x [m, cols] fp32 -> [m, rows] fp32 (fp64 inside)."""
    w = torch.cat([dequantize(q, d, cols) for q, d in segments])
    return (x.double() @ w.double().T).float()


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     seq_lens: list[int], block_tables: torch.Tensor, scale: float,
                     sliding_window: int | None = None) -> torch.Tensor:
    """Twin of `cpu_attention.decode_attention`: q [num_seqs, heads, dim] -> same."""
    return reference.paged_attention(q, k_cache.to(q.dtype), v_cache.to(q.dtype),
                                     list(range(q.shape[0] + 1)), seq_lens, block_tables,
                                     scale, sliding_window)

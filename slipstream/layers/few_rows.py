"""Few-row products (a decode step of 2..MAX_ROWS requests) through the tensor-core
skinny GEMM (kernels/skinny_gemm.py) instead of cuBLAS, for the products named.

Alone on an H200 the kernel ran Llama-3-8B's qkv and o_proj at 8-32 rows 1.01-1.14x
cuBLAS's speed (gate_up at 32 rows 1.07x, down 0.90-0.97x;
benchmarks/runtime/results/skinny_gemm_h200_2026-12-03). Which products take it:
`ROLES` (from SLIPSTREAM_SKINNY_GEMM, a comma list of qkv, o, gate_up, down; empty by
default: cuBLAS everywhere). The product's weight tiles per role: `CONFIGS`, the best
of the benchmark's configs at those shapes.
"""
from __future__ import annotations

import os

import torch
from torch import nn

from slipstream.kernels.runtime import interpreting

MAX_ROWS = 32
ROLES = frozenset(r for r in os.environ.get("SLIPSTREAM_SKINNY_GEMM", "").split(",") if r)
_N64_K128 = {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 5}
CONFIGS = {"qkv": _N64_K128, "o": _N64_K128, "down": _N64_K128,
           "gate_up": {"BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}}


def linear(layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """x @ layer.weight^T through the skinny GEMM where it is enabled and fits; else None."""
    role = getattr(layer, "gemv_role", None)
    if role not in ROLES or not 1 < x.shape[0] <= MAX_ROWS or getattr(layer, "bias", None) is not None:
        return None
    if not (x.is_cuda or interpreting()) or getattr(layer, "tp_size", 1) != 1:
        return None
    from slipstream.kernels.skinny_gemm import fits, skinny_gemm
    w = layer.weight
    if not (fits(x, w) and w.is_contiguous()):
        return None
    return skinny_gemm(x, w, config=CONFIGS.get(role))

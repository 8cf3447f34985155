"""Few-row products (a decode step of a few requests) through the tensor-core skinny
GEMM (kernels/skinny_gemm.py) instead of cuBLAS, for the products named.

Alone on an H200 the kernel ran Llama-3-8B's qkv and o_proj at 8-32 rows 1.01-1.14x
cuBLAS's speed (gate_up 0.95x at 8 rows, 0.98-1.07x at 16-32; down 0.90-0.97x;
benchmarks/runtime/results/skinny_gemm_h200_2026-12-03). Through the engine on an H100
(Llama-3-8B shape, random bf16 weights, one process alternating the settings,
benchmarks/runtime/bench_switch.py --switch skinny): qkv and o_proj at 2-32 rows made
decode 1.1-2.0% faster at batch 8-32; gate_up as well 2.7-3.0% at batch 16-32 but 1.1%
slower at batch 8; batch 64 (cuBLAS: over MAX_ROWS) and batch 1 (the GEMV) unchanged.
Hence the default: qkv and o from 2 rows, gate_up from 16 (`ROWS`); on a second H100 the
default ran batch 16-32 1.6-2.1% faster and batch 8 1.1% slower than cuBLAS.

Which products take it: `ROLES` (from SLIPSTREAM_SKINNY_GEMM, a comma list of qkv, o,
gate_up, down; 0 or empty for none), on a CUDA device at tensor-parallel size 1, for
unquantized 16-bit weights without a bias. The product's weight tiles per role: `CONFIGS`,
the best of the benchmark's configs at those shapes.
"""
from __future__ import annotations

import os

import torch
from torch import nn

from slipstream.kernels.runtime import interpreting

MAX_ROWS = 32
# (Triton's CPU interpreter only when asked: tests)
_DEFAULT = "" if interpreting() else "qkv,o,gate_up"
ROLES = frozenset(r for r in os.environ.get("SLIPSTREAM_SKINNY_GEMM", _DEFAULT).split(",")
                  if r not in ("", "0"))
ROWS = {"qkv": 2, "o": 2, "gate_up": 16, "down": 2}     # the fewest rows a role takes it at
_N64_K128 = {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 5}
CONFIGS = {"qkv": _N64_K128, "o": _N64_K128, "down": _N64_K128,
           "gate_up": {"BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}}


def linear(layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """x @ layer.weight^T through the skinny GEMM where it is enabled and fits; else None."""
    role = getattr(layer, "gemv_role", None)
    if role not in ROLES or not ROWS.get(role, 2) <= x.shape[0] <= MAX_ROWS \
            or getattr(layer, "bias", None) is not None:
        return None
    if not (x.is_cuda or interpreting()) or getattr(layer, "tp_size", 1) != 1:
        return None
    from slipstream.kernels.skinny_gemm import fits, skinny_gemm
    w = layer.weight
    if not (fits(x, w) and w.is_contiguous()):
        return None
    return skinny_gemm(x, w, config=CONFIGS.get(role))

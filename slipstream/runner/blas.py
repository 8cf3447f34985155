"""cuBLAS without a workspace, so without split-K, for the engine's products.

With its default workspace cuBLAS(Lt) answers the decode step's skinny
products (1-64 rows against 4096-28672 columns) with split-K kernels plus a
`splitKreduce` kernel after each; without one it picks unsplit kernels, which
the decode step prefers. Measured on the H200 (Llama-3-8B shape, random bf16
weights, each setting in its own process, three alternating repeats,
benchmarks/runtime/bench_blas_variants.py): decode +1.6% at batch 1, +3.3% at
8, +4.4% at 64; an 8,192-token prefill -2%.

The size is read once, when the process's first cuBLAS call makes a workspace,
so it is set before the model runs anything; a value the user set
(`CUBLAS_WORKSPACE_CONFIG=:4096:8` for deterministic algorithms, say) stands.
`SLIPSTREAM_CUBLAS_WORKSPACE=torch` leaves torch's defaults.
"""
from __future__ import annotations

import os

_SETTINGS = {"CUBLAS_WORKSPACE_CONFIG": ":0:0", "CUBLASLT_WORKSPACE_SIZE": "0"}


def prefer_unsplit_gemms() -> dict[str, str]:
    """Ask for no cuBLAS workspace where nothing says otherwise; returns what was set."""
    if os.environ.get("SLIPSTREAM_CUBLAS_WORKSPACE", "none") == "torch":
        return {}
    if any(k in os.environ for k in _SETTINGS):      # the user's choice
        return {}
    os.environ.update(_SETTINGS)
    return dict(_SETTINGS)

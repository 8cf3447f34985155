"""A few to 64 rows times a 16-bit weight on tensor cores: the engine's qkv, o_proj and
gate_up products of 2-32 rows on CUDA (layers/few_rows.py says which and why).

y[m, n] = sum_k x[m, k] * w[n, k] for M <= 64 rows, w as nn.Linear keeps it ([N, K],
rows contiguous). Program i owns BLOCK_N output features and all M rows: it streams
its [BLOCK_N, K] slice of the weight in BLOCK_K steps (num_stages of them in flight)
and multiplies each with the [K-step, M] slice of x by `tl.dot`; no split over K, no
reduce pass. Plain-PyTorch twin: torch.nn.functional.linear.

Written for tree verification on a small model: in the H200 kernel profile of an
EAGLE loop round on SmolLM2-135M (61 tree tokens, hidden 576) cuBLAS ran the four
products of a layer at ~4 us each, ~0.5 ms of the round, for weights of 0.7-3.5 MB
(0.2-0.9 us at the copy bandwidth). Measured on the H200
(benchmarks/runtime/bench_skinny_gemm.py, results/skinny_gemm_h200_2026-12-03):
alone, 61 rows, SmolLM2's products take 3.8-6.4 us here against 3.7-5.2 with cuBLAS
(0.82-1.00x; 16 rows 1.04-1.15x): both are bound by latency, not bytes. Inside the
loop's round the target's products took 1.10-1.20 ms against cuBLAS's 0.99 whatever
the config, so tree verification keeps cuBLAS. Llama-3-8B's qkv and o_proj at 8-32 rows
run 1.04-1.14x cuBLAS alone (gate_up, down 0.90-1.07x); through the engine they make
decode of 8-32 requests a little faster (layers/few_rows.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from slipstream.kernels.attention_tile import next_pow2
from slipstream.kernels.runtime import interpreting

MAX_ROWS = 64
DEFAULT_CONFIG = {"BLOCK_N": 32, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4}
INTERPRET_CONFIG = {"BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 4, "num_stages": 1}


@triton.jit(do_not_specialize=["M"])
def _skinny_kernel(X, W, Y, M, N, K, stride_xm, stride_wn, stride_ym,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   EVEN_K: tl.constexpr, F32_DOT: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    k = tl.arange(0, BLOCK_K)
    w_ptr = W + tl.minimum(n, N - 1).to(tl.int64)[:, None] * stride_wn + k[None, :]
    x_ptr = X + tl.minimum(m, M - 1).to(tl.int64)[None, :] * stride_xm + k[:, None]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptr)
            x = tl.load(x_ptr)
        else:
            k_ok = k0 + k < K
            w = tl.load(w_ptr, mask=k_ok[None, :], other=0.0)
            x = tl.load(x_ptr, mask=k_ok[:, None], other=0.0)
        if F32_DOT:   # Triton 3.6's interpreter multiplies bf16 dot operands as raw bits
            w = w.to(tl.float32)
            x = x.to(tl.float32)
        acc += tl.dot(w, x)                      # [BLOCK_N, K-step] @ [K-step, BLOCK_M]
        w_ptr += BLOCK_K
        x_ptr += BLOCK_K
    y = Y + m.to(tl.int64)[None, :] * stride_ym + n[:, None]
    tl.store(y, acc.to(Y.dtype.element_ty), mask=(n < N)[:, None] & (m < M)[None, :])


def fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """2-D x of 2..MAX_ROWS rows, x and w of one 16-bit dtype, unit last strides."""
    return (x.dim() == 2 and w.dim() == 2 and 1 < x.shape[0] <= MAX_ROWS
            and x.dtype == w.dtype and x.dtype in (torch.bfloat16, torch.float16)
            and x.shape[1] == w.shape[1] and x.stride(1) == 1 and w.stride(1) == 1
            and x.shape[1] % 8 == 0)


def skinny_gemm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
                config: dict | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS), w [N, K] -> x @ w.T [M, N] in x's dtype (fp32 sums)."""
    if not fits(x, w):
        raise ValueError(f"skinny_gemm: x {tuple(x.shape)} {x.dtype}, w {tuple(w.shape)} "
                         f"{w.dtype}: wants 2..{MAX_ROWS} rows of one 16-bit dtype")
    m, k = x.shape
    n = w.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    cfg = dict(INTERPRET_CONFIG if interpreting() else (config or DEFAULT_CONFIG))
    block_n, block_k = cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K")
    _skinny_kernel[(triton.cdiv(n, block_n),)](
        x, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0),
        BLOCK_M=max(16, next_pow2(m)), BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN_K=k % block_k == 0, F32_DOT=interpreting(), **cfg)
    return out

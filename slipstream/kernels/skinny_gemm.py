"""A few to 64 rows times a 16-bit weight on tensor cores: the products of a draft
tree's verification (a tree of ~60 nodes for one request) on a small model.

y[m, n] = sum_k x[m, k] * w[n, k] for M <= 64 rows, w as nn.Linear keeps it ([N, K],
rows contiguous). Program i owns BLOCK_N output features and all M rows: it streams
its [BLOCK_N, K] slice of the weight in BLOCK_K steps (num_stages of them in flight)
and multiplies each with the [K-step, M] slice of x by `tl.dot`; no split over K, no
reduce pass. Plain-PyTorch twin: torch.nn.functional.linear.

Why: in the H200 kernel profile of an EAGLE loop round on SmolLM2-135M (61 tree
tokens, hidden 576; benchmarks/spec/README.md) cuBLAS ran the four products of a
layer at ~4 us each, 120 of them ~0.5 ms of a ~1.9-ms round, for weights of 0.7-3.5
MB (0.2-0.9 us at the copy bandwidth): tiles of 8 tokens and 16 K-columns, so each
program walks K in 36+ serial steps. `benchmarks/runtime/bench_skinny_gemm.py`
times this kernel against cuBLAS on those shapes and on Llama-3-8B's.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton.language.extra.cuda import gdc_wait

from slipstream.kernels.attention_tile import next_pow2
from slipstream.kernels.dense_gemv import _prefetch_l2
from slipstream.kernels.runtime import interpreting, pdl_supported

MAX_ROWS = 64
DEFAULT_CONFIG = {"BLOCK_N": 32, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4}
# The engine's unquantized products of 2..MAX_ROWS rows on a GPU take this kernel
# (layers/linear.py) when True. Off until timed through the engine.
enabled = False
# "BLOCK_NxBLOCK_KxWARPSxSTAGES" to force one config (benchmark A/B runs); "" chooses.
config_override = ""
# True: launched early (programmatic dependent launch, sm_90): a program asks L2 for
# the first PREFETCH_K columns of its weight rows, then waits for the kernel before
# (which wrote x). Pays only after kernels that let it launch early
# (rms_norm.signal_dependents).
chain = False
PREFETCH_K = 1024
INTERPRET_CONFIG = {"BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 4, "num_stages": 1}


@triton.jit(do_not_specialize=["M"])
def _skinny_kernel(X, W, Y, M, N, K, stride_xm, stride_wn, stride_ym,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   EVEN_K: tl.constexpr, F32_DOT: tl.constexpr, CHAIN: tl.constexpr,
                   PREFETCH_K: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    k = tl.arange(0, BLOCK_K)
    w_rows = W + tl.minimum(n, N - 1).to(tl.int64)[:, None] * stride_wn
    if CHAIN:  # the weight is no kernel's output: ask for it, then wait for x
        LINE: tl.constexpr = 1024 // W.dtype.element_ty.primitive_bitwidth
        cols = tl.arange(0, PREFETCH_K // LINE) * LINE
        _prefetch_l2(w_rows + tl.minimum(cols, K - 1)[None, :])
        gdc_wait()
    w_ptr = w_rows + k[None, :]
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


def choose_config(m: int, n: int, k: int) -> dict:
    """The launch config for x [m, k] @ w [n, k]^T (chosen ahead, never tuned in a step)."""
    if config_override:
        bn, bk, w, st = (int(v) for v in config_override.split("x"))
        return {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w, "num_stages": st}
    return DEFAULT_CONFIG


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
    cfg = dict(INTERPRET_CONFIG if interpreting() else (config or choose_config(m, n, k)))
    block_n, block_k = cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K")
    link = chain and pdl_supported(x)
    _skinny_kernel[(triton.cdiv(n, block_n),)](
        x, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0),
        BLOCK_M=max(16, next_pow2(m)), BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN_K=k % block_k == 0, F32_DOT=interpreting(), CHAIN=link,
        PREFETCH_K=min(PREFETCH_K, next_pow2(k)), launch_pdl=link, **cfg)
    return out

"""A few rows times a 16-bit weight (decode GEMV), with the weight streamed early.

y[m, n] = sum_k x[m, k] * w[n, k] for M <= 4 rows, w as nn.Linear keeps it
([N, K], rows contiguous). Program i owns BLOCK_N output features and streams
their whole rows, so no split over K and no reduce pass (cuBLAS at batch 1
runs o_proj and down_proj of Llama-3-8B split over K and then a reduce kernel).

The weight is not written by any kernel of the step, so on Hopper the kernel
can be launched while the kernel before it still runs (programmatic dependent
launch, PDL): before it waits on that kernel it asks L2 for the first
PREFETCH_K columns of its rows, which then arrive while the kernel before
finishes (at decode that kernel is latency-bound: the memory is otherwise
idle); only x, that kernel's output, is read after the wait.
Plain-PyTorch twin: torch.nn.functional.linear.

Measured on an H200 (benchmarks/runtime/bench_decode_kernels.py, commit 24e2adb,
batch 1, best of four configs): slower than cuBLAS at every Llama-3-8B weight,
qkv 19.6 against 16.1 us, o_proj 16.6 against 13.4, gate_up 68.4 against 55.5,
down 50.5 against 31.4; after the kernel before it, launched early, with or
without the L2 prefetch, slower too (qkv after RMSNorm 21.6-26.1 against 18.7).
The engine does not use it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton.language.extra.cuda import gdc_wait

from slipstream.kernels.attention_tile import next_pow2
from slipstream.kernels.runtime import interpreting, pdl_supported

MAX_ROWS = 4
DEFAULT_CONFIG = {"BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 4, "num_stages": 4,
                  "PREFETCH_K": 0}
INTERPRET_CONFIG = {"BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 4, "num_stages": 1,
                    "PREFETCH_K": 0}


@triton.jit
def _prefetch_l2(ptrs):
    """Ask L2 for the 128-byte line at each pointer; nothing comes back to registers."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _gemv_kernel(X, W, Y, M, N, K, stride_xm, stride_wn, stride_ym,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PREFETCH_K: tl.constexpr, CHAIN: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    w_rows = W + tl.minimum(n, N - 1).to(tl.int64)[:, None] * stride_wn
    if PREFETCH_K > 0:  # one request per 128-byte line of the first PREFETCH_K columns
        LINE: tl.constexpr = 1024 // W.dtype.element_ty.primitive_bitwidth
        cols = tl.arange(0, PREFETCH_K // LINE) * LINE
        _prefetch_l2(w_rows + tl.minimum(cols, K - 1)[None, :])
    if CHAIN:  # launched early: x may still be being written
        gdc_wait()
    m = tl.arange(0, BLOCK_M)
    m_ok = m < M
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(X + m[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0)
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], 2)
    tl.store(Y + m[:, None] * stride_ym + n[None, :], acc.to(Y.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def dense_gemv(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None,
               config: dict | None = None) -> torch.Tensor:
    """x: [M, K] (M <= MAX_ROWS, last dim contiguous); weight: [N, K] (rows contiguous),
    same dtype -> out: [M, N] in x's dtype (fp32 accumulation). config: overrides of
    DEFAULT_CONFIG (BLOCK_N, BLOCK_K, num_warps, num_stages, PREFETCH_K, CHAIN)."""
    m, k = x.shape
    n = weight.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"dense_gemv takes at most {MAX_ROWS} rows, got {m}")
    if weight.shape[1] != k:
        raise ValueError(f"x has {k} columns, the weight {weight.shape[1]}")
    assert x.stride(1) == 1 and weight.stride(1) == 1 and x.dtype == weight.dtype
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    cfg = {**(INTERPRET_CONFIG if interpreting() else DEFAULT_CONFIG), **(config or {})}
    block_n, block_k = cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K")
    chain = cfg.pop("CHAIN", True) and pdl_supported(x)
    prefetch = min(cfg.pop("PREFETCH_K"), next_pow2(k))
    if not chain:  # nothing to overlap
        prefetch = 0
    if prefetch:  # a power of two, at least one 128-byte line (columns past K clamped)
        prefetch = 1 << (prefetch.bit_length() - 1)
        if prefetch < 128 // weight.element_size():
            prefetch = 0
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=next_pow2(m), BLOCK_N=block_n, BLOCK_K=block_k, PREFETCH_K=prefetch,
        CHAIN=chain, launch_pdl=chain, **cfg)
    return out

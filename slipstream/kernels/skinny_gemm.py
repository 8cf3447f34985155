"""y = x W^T for a few rows of x: the weight-streaming matmul of small-batch decode.

At batch 1-16 a decode step's linear layers are bound by reading their weights;
cuBLAS picks good kernels for the large ones, but for the 4096-wide square and
QKV shapes of an 8B model it ran at 75-78% of copy bandwidth on the H200, and
split-K variants add a reduction kernel (benchmarks/runtime, profile stage).

The kernel gives each program BLOCK_N output features and streams their weight
rows in BLOCK_K slices (pipelined loads), so the whole grid reads the weight
exactly once. Two inner products:
  - BLOCK_M == 1 (one row of x): multiply and sum over K in fp32 registers;
  - BLOCK_M == 16 (up to 16 rows): `tl.dot` on the tensor cores.
Either way the sum is in fp32 and rounded once to the output dtype, as cuBLAS
does, but in a different order, so outputs differ from F.linear by rounding.

Which kernel runs for a layer is decided once at start-up (`tune`): each
config of a fixed set and F.linear are timed inside a CUDA graph over all the
model's weights of that shape (distinct weights, as in a real step, so nothing
is served from L2), and the layer keeps the fastest, F.linear included. The
grid depends only on the shapes (CUDA-graph safe). Twin: `reference.linear`.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from slipstream.kernels import reference
from slipstream.kernels import runtime  # noqa: F401  (the interpreter fix for runtime loop bounds)

MAX_ROWS = 16


@dataclass(frozen=True)
class SkinnyConfig:
    block_m: int  # 1 (multiply-and-sum) or 16 (tl.dot)
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4


# The fixed sets timed at start-up, by row class (1 row; 2-16 rows).
CONFIGS = {
    1: [SkinnyConfig(1, 8, 1024, 4, 3), SkinnyConfig(1, 16, 512, 4, 4), SkinnyConfig(1, 32, 256, 4, 4),
        SkinnyConfig(16, 32, 256, 4, 4), SkinnyConfig(16, 16, 512, 4, 3)],
    16: [SkinnyConfig(16, 32, 256, 4, 4), SkinnyConfig(16, 16, 512, 4, 3), SkinnyConfig(16, 64, 128, 4, 5)],
}


@triton.jit(do_not_specialize=["M"])
def _skinny_kernel(X, W, Bias, Y, M, N, K, stride_xm, stride_wn, stride_ym,
                   HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    w_ptrs = W + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
    if BLOCK_M == 1:
        acc = tl.zeros([BLOCK_N], tl.float32)
        x_ptrs = X + rk
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            k_ok = rk < K - k * BLOCK_K
            x = tl.load(x_ptrs, mask=k_ok, other=0.0).to(tl.float32)
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(w * x[None, :], axis=1)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if HAS_BIAS:
            acc += tl.load(Bias + rn, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(Y + rn, acc.to(Y.dtype.element_ty), mask=n_ok)
    else:
        rm = tl.arange(0, BLOCK_M)
        m_ok = rm < M
        acc2 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        x_ptrs2 = X + rm[:, None] * stride_xm + rk[None, :]
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            k_ok = rk < K - k * BLOCK_K
            x2 = tl.load(x_ptrs2, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w2 = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc2 += tl.dot(x2, tl.trans(w2))
            x_ptrs2 += BLOCK_K
            w_ptrs += BLOCK_K
        if HAS_BIAS:
            acc2 += tl.load(Bias + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + rm[:, None] * stride_ym + rn[None, :], acc2.to(Y.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  config: SkinnyConfig) -> torch.Tensor:
    """x: [M, K] (M <= config.block_m, or M == 1), weight: [N, K] -> [M, N] in x's dtype."""
    m, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k and weight.stride(1) == 1 and x.stride(1) == 1
    assert m <= max(config.block_m, 1) or (config.block_m == 1 and m == 1), (m, config)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    _skinny_kernel[(triton.cdiv(n, config.block_n),)](
        x, weight, bias if bias is not None else weight, y, m, n, k,
        x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, num_warps=config.num_warps, num_stages=config.num_stages)
    return y


def row_class(m: int) -> int | None:
    """The tuned class a step of m rows uses (None: too many rows, F.linear)."""
    if m == 1:
        return 1
    return MAX_ROWS if m <= MAX_ROWS else None


def _graph_time_ms(calls, replays: int = 7) -> float:
    """Median ms per call of `calls` replayed in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return statistics.median(times) / len(calls)


def tune(weights: list[torch.Tensor], rows: int) -> tuple[SkinnyConfig | None, dict]:
    """The fastest way to multiply `rows` rows by each of `weights` (all [N, K],
    one dtype, CUDA): a config, or None when F.linear is fastest. Also returns
    every candidate's time (ms per call) for the log."""
    w0 = weights[0]
    x = torch.randn(rows, w0.shape[1], dtype=w0.dtype, device=w0.device)
    times = {"F.linear": _graph_time_ms([lambda w=w: torch.nn.functional.linear(x, w) for w in weights])}
    best, best_ms = None, times["F.linear"]
    want = reference.linear(x, w0, None).float()
    for cfg in CONFIGS[1 if rows == 1 else MAX_ROWS]:
        if rows > 1 and cfg.block_m == 1:
            continue
        try:
            got = skinny_linear(x, w0, None, cfg).float()
            err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()
            if err > 1e-2:   # never expected; a miscompiled config must not be chosen
                times[str(cfg)] = f"wrong output (relative error {err:.2e})"
                continue
            ms = _graph_time_ms([lambda w=w: skinny_linear(x, w, None, cfg) for w in weights])
        except Exception as exc:  # a config the GPU cannot hold (shared memory): skip it
            times[str(cfg)] = repr(exc)[:80]
            continue
        times[str(cfg)] = ms
        if ms < best_ms:
            best, best_ms = cfg, ms
    return best, times

"""Timing and data helpers for the attention benchmark (CUDA only)."""
from __future__ import annotations

import statistics

import torch
import triton

from benchmarks.cuda_timing import graph_timer  # noqa: F401  (re-exported)

DEVICE = "cuda"  # a CPU dry run (interpreter, tiny shapes) sets "cpu"


def bench_ms(fn) -> float:
    """Median ms of `fn` (triton do_bench: L2 flushed before every run)."""
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def bench_graph_ms(calls, min_calls: int = 64, replays: int = 10) -> float:
    """Median ms per call of `calls` replayed in a CUDA graph (see graph_timer)."""
    return graph_timer(calls, min_calls, replays)()


def interleaved(timers: dict, rounds: int = 5) -> dict:
    """Time every contender once a round, `rounds` rounds: clock and thermal
    drift during the run then hits all of them alike. timers: name -> zero-arg
    function returning ms. Returns name -> {"ms": median, "spread": (max -
    min) / median}."""
    times = {name: [] for name in timers}
    for _ in range(rounds):
        for name, timer in timers.items():
            times[name].append(timer())
    return {name: {"ms": statistics.median(ts), "spread": (max(ts) - min(ts)) / statistics.median(ts)}
            for name, ts in times.items()}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp64; NaN anywhere gives inf."""
    out, ref = out.double(), ref.double()
    if out.isnan().any():
        return float("inf")
    return ((out - ref).norm() / ref.norm()).item()


def paged_copy(k: torch.Tensor, v: torch.Tensor, page_size: int, gen: torch.Generator):
    """Contiguous per-request K/V [B, L, Hkv, D] -> (k_cache, v_cache, block_tables)
    holding the same data in randomly permuted pages (L a multiple of page_size)."""
    b, length, hkv, d = k.shape
    pages = length // page_size
    perm = torch.randperm(b * pages, generator=gen).to(k.device)
    k_cache = torch.empty(b * pages, page_size, hkv, d, dtype=k.dtype, device=k.device)
    v_cache = torch.empty_like(k_cache)
    k_cache[perm] = k.reshape(b * pages, page_size, hkv, d)
    v_cache[perm] = v.reshape(b * pages, page_size, hkv, d)
    return k_cache, v_cache, perm.view(b, pages).to(torch.int32)


def cu_seqlens(lengths, device) -> torch.Tensor:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=device)

"""Timing and data helpers for the attention benchmark (CUDA only)."""
from __future__ import annotations

import math
import statistics

import torch
import triton

DEVICE = "cuda"  # a CPU dry run (interpreter, tiny shapes) sets "cpu"


def bench_ms(fn) -> float:
    """Median ms of `fn` (triton do_bench: L2 flushed before every run)."""
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def graph_timer(calls, min_calls: int = 64, replays: int = 10):
    """Capture `calls` (zero-arg callables over different data copies, so
    repeated runs do not hit L2) in one CUDA graph, launch overhead out of
    microsecond-scale kernels; returns a function giving the median ms per call
    over `replays` replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in calls:  # compile and warm up outside the capture
            c()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    rounds = math.ceil(min_calls / len(calls))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(rounds):
            for c in calls:
                c()
    graph.replay()
    torch.cuda.synchronize()

    def time_ms() -> float:
        times = []
        for _ in range(replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times) / (rounds * len(calls))
    return time_ms


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

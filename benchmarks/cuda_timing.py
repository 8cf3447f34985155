"""CUDA-graph timing shared by the benchmarks: launch overhead out of
microsecond-scale kernels, median of several replays."""
from __future__ import annotations

import math
import statistics

import torch


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

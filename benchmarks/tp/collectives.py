"""The all-reduce stage of bench_tp.py: NCCL all-reduces of a decode row and of
64 MiB, eager and in CUDA graphs, the opt-in symmetric-memory one-shot, and a
decode row's sum + residual add + RMSNorm: NCCL + cast + norm kernel against the
fused kernel (distributed/all_reduce_norm.py), both protocols."""
from __future__ import annotations

import os
import statistics
import time


def _graph_us(call, calls: int = 20) -> float:
    """Median microseconds per call of `calls` calls captured in one CUDA graph
    (warmed up on a side stream first), over 20 replays."""
    import torch
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            call()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        g.replay()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times) * 1e6


def _allreduce_rank(rank: int, port: int, smoke: bool, queue) -> None:
    import torch
    import torch.distributed as dist
    device = torch.device("cpu") if smoke else torch.device("cuda", rank)
    if not smoke:
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if smoke else "nccl", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=2)
    dtype = torch.float32 if smoke else torch.bfloat16
    results, ar = {}, None
    for label, nbytes in (("8KiB", 8 << 10), ("16KiB", 16 << 10), ("64MiB", 64 << 20)):
        x = torch.ones(nbytes // torch.empty((), dtype=dtype).element_size(), dtype=dtype,
                       device=device)
        reps = 20 if smoke or nbytes > 1 << 20 else 200
        for _ in range(10):
            dist.all_reduce(x)
        times = []
        for _ in range(reps):
            if not smoke:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            if not smoke:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        row = {"bytes": nbytes, "eager_us": statistics.median(times) * 1e6}
        if not smoke:   # 20 all-reduces captured in one graph, replayed
            row["graph_us"] = _graph_us(lambda: dist.all_reduce(x))
            if nbytes <= 1 << 20 and os.environ.get("SLIPSTREAM_SYMM_ALL_REDUCE") == "1":
                # the one-shot all-reduce the engine can use for these (opt-in)
                try:
                    if ar is None:   # one buffer (1 MiB) serves every small size
                        from slipstream.distributed.symm_all_reduce import SymmAllReduce
                        ar = SymmAllReduce(dist.group.WORLD, device, dtype)
                    y = torch.ones_like(x)
                    ar(y)
                    torch.cuda.synchronize()
                    row["symm_correct"] = bool((y == 2).all())
                    row["symm_graph_us"] = _graph_us(lambda: ar(y))
                except Exception as exc:
                    row["symm_error"] = repr(exc)[:300]
        row["bus_GBps_eager"] = nbytes / (row["eager_us"] * 1e-6) / 1e9   # 2(N-1)/N = 1 at N=2
        results[label] = row
    if not smoke:
        results["norm"] = _fused_norm_us(device)
    if rank == 0:
        queue.put(results)
    dist.barrier()
    dist.destroy_process_group()


def _fused_norm_us(device) -> dict:
    """What a decode row's sum costs the layer: NCCL all-reduce of the fp32 partial +
    cast + residual add + RMSNorm (three kernels), against the fused kernel
    (distributed/all_reduce_norm.py), both in CUDA graphs; hidden 4096 and 8192."""
    import torch
    import torch.distributed as dist
    from slipstream.distributed.all_reduce_norm import AllReduceNorm
    from slipstream.kernels.rms_norm import rms_norm
    out = {}
    for hidden in (4096, 8192):
        row = {}
        partial = torch.randn(1, hidden, device=device)
        residual = torch.randn(1, hidden, device=device).to(torch.bfloat16)
        weight = torch.ones(hidden, device=device, dtype=torch.bfloat16)

        def plain():
            y = partial.clone()
            dist.all_reduce(y)
            return rms_norm(y.to(torch.bfloat16), weight, 1e-5, residual)
        row["nccl_cast_norm_us"] = _graph_us(plain)
        for protocol in ("lamport", "flags"):
            key = "fused" if protocol == "lamport" else "fused_flags"
            try:
                op = AllReduceNorm(dist.group.WORLD, device, hidden, protocol=protocol)
                got, want = op(partial, residual, weight, 1e-5), plain()
                torch.cuda.synchronize()
                row[f"{key}_correct"] = bool(torch.equal(got[0], want[0])
                                             and torch.equal(got[1], want[1]))
                row[f"{key}_us"] = _graph_us(lambda: op(partial, residual, weight, 1e-5))
            except Exception as exc:
                row[f"{key}_error"] = repr(exc)[:300]
        out[f"hidden{hidden}"] = row
    return out


def stage_allreduce(smoke: bool) -> dict:
    import torch.multiprocessing as mp
    from slipstream.distributed.parallel import host_store
    store = host_store(1)   # only to find a free port the ranks then meet at
    port = store.port
    del store
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_allreduce_rank, args=(r, port, smoke, queue)) for r in range(2)]
    for p in procs:
        p.start()
    result = queue.get(timeout=240)
    for p in procs:
        p.join(timeout=60)
    return result

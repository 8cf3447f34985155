"""Launch configurations of the quantized GEMMs (kernels/quant_gemm.py), chosen by measurement.

The best tile shape of a quantized GEMM depends on the GPU, the weight shape and the number
of tokens: a batch-1 GEMV is bound by the weight stream and wants many programs in flight
(narrow N tiles, split-K), a prefill wants large tensor-core tiles. `choose` times a fixed
candidate set once per (kernel, weight shape, dtype, token-count bucket), keeps the fastest
and returns it from then on. Tuning happens in eager runs only: the engine's warm-up (the
memory-profiling forward, the eager run before each CUDA-graph capture) meets every bucket
before it is captured; during a capture, or for a bucket never tuned, the static default is
used. No host synchronization happens outside tuning.

Timing: the candidate's calls over several copies of the weight (together more than twice
the L2 cache, so the weight streams from memory as it does in a decode step), replayed in a
CUDA graph (launch overhead out), best of a few replays. `SLIPSTREAM_QUANT_TUNE=0` turns
tuning off (the defaults are used).
"""
from __future__ import annotations

import logging
import math
import os

import torch
import triton

log = logging.getLogger(__name__)

_BEST: dict[tuple, dict] = {}


def m_bucket(m: int) -> int:
    """Token counts sharing one configuration: powers of two (1, 2, 4, ..., then 8192+)."""
    return 1 << max(0, min(m - 1, 8191)).bit_length()


def tuning_enabled(device: torch.device) -> bool:
    from slipstream.kernels.runtime import interpreting
    return (device.type == "cuda" and not interpreting()
            and os.environ.get("SLIPSTREAM_QUANT_TUNE", "1") not in ("", "0"))


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def tuned_configs() -> dict[tuple, dict]:
    """Every configuration chosen so far: (kernel key..., m bucket) -> config."""
    return dict(_BEST)


def choose(key: tuple, m: int, device: torch.device, default: dict, candidates,
           weights: tuple, timed_calls) -> dict:
    """The configuration for `key` at `m` tokens. candidates: () -> list of configs;
    weights: the tensors a call reads (copied for timing); timed_calls(cfg, copies) -> one
    zero-argument call per copy."""
    full = key + (m_bucket(m),)
    cfg = _BEST.get(full)
    if cfg is not None:
        return cfg
    if not tuning_enabled(device) or _capturing(device):
        return default
    copies = _weight_copies(weights, device)
    best = None
    for cand in candidates():
        try:
            ms = _time_calls(timed_calls(cand, copies))
        except Exception as e:   # e.g. a tile that needs more shared memory than there is
            log.debug("quantized GEMM config %s skipped: %s", cand, e)
            continue
        if best is None or ms < best[0]:
            best = (ms, cand)
    del copies
    cfg = _BEST[full] = best[1] if best is not None else default
    log.debug("quantized GEMM %s: %s (%.4f ms)", full, cfg, best[0] if best else float("nan"))
    return cfg


def _weight_copies(weights: tuple, device: torch.device) -> list[tuple]:
    nbytes = sum(t.numel() * t.element_size() for t in weights if t is not None)
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)
    count = max(1, min(8, math.ceil(2 * l2 / max(nbytes, 1))))
    clone = lambda t: None if t is None else t.clone()  # noqa: E731
    return [weights] + [tuple(clone(t) for t in weights) for _ in range(count - 1)]


def _time_calls(calls, min_calls: int = 24, replays: int = 3) -> float:
    """Milliseconds per call: `calls` compiled and run once eagerly, then captured
    (repeated to at least `min_calls`) in a CUDA graph; best of `replays` replays."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    rounds = math.ceil(min_calls / len(calls))
    graph = torch.cuda.CUDAGraph()
    # thread_local: work other threads of the engine issue meanwhile is not part of it
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for _ in range(rounds):
            for c in calls:
                c()
    graph.replay()
    best = float("inf")
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end))
    return best / (rounds * len(calls))


# ---- candidates and defaults: BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages[, SPLIT_K] ----
# The defaults serve the CPU interpreter, tuning switched off, and a graph capture that
# meets a bucket no eager run tuned.

def default_config(m: int, k_block_limit: int) -> dict:
    """Decode-sized M: thin row tiles, wide K steps (a GEMV streaming the weight);
    prefill-sized M: square tensor-core tiles."""
    bk = min(128, k_block_limit)
    if m <= 16:
        cfg = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=bk, num_warps=4, num_stages=4)
    elif m <= 64:
        cfg = dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=bk, num_warps=4, num_stages=4)
    else:
        cfg = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=min(64, bk), num_warps=8, num_stages=3)
    return cfg


def _cfg(bm, bn, bk, warps, stages, **extra) -> dict:
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages, **extra)


def int_weight_candidates(m: int, n: int, k: int, k_block_limit: int, device) -> list[dict]:
    """The configurations tuning tries for the weight-only kernel. Batch <= 16: a GEMV
    bound by the weight stream, which needs many programs in flight: narrow N tiles,
    deep pipelines, and split-K (partial sums over runs of K, added by a second small
    kernel) where the output tiles alone are too few for the SMs."""
    lim = min(128, k_block_limit)
    if m <= 16:
        tiles = [_cfg(16, bn, min(bk, lim), w, st) for bn, bk, w, st in (
            (16, 128, 2, 4), (16, 128, 4, 6), (32, 128, 4, 4), (32, 128, 2, 6), (64, 128, 4, 4),
            (64, 64, 4, 6), (128, 128, 4, 3), (128, 64, 8, 4))]
    elif m <= 64:
        tiles = [_cfg(bm, bn, min(bk, lim), 4, st) for bm, bn, bk, st in (
            (16, 64, 128, 4), (32, 64, 128, 4), (32, 128, 128, 4), (64, 64, 128, 4),
            (64, 128, 64, 4), (64, 128, 128, 3))]
    else:
        tiles = [_cfg(bm, bn, min(bk, lim), w, st) for bm, bn, bk, w, st in (
            (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (64, 128, 64, 4, 4),
            (128, 128, 128, 8, 3), (128, 64, 64, 4, 4), (256, 128, 64, 8, 3))]
    out, seen = [], set()
    for t in tiles:
        n_tiles = triton.cdiv(m, t["BLOCK_M"]) * triton.cdiv(n, t["BLOCK_N"])
        for split in (1, split_k_for(n_tiles, triton.cdiv(k, t["BLOCK_K"]), device)):
            c = dict(t, SPLIT_K=split)
            key = tuple(sorted(c.items()))
            if key not in seen:
                seen.add(key)
                out.append(c)
    return out


def w4_mma_candidates(default: dict, k: int, m: int, wgmma: bool = False) -> list[dict]:
    """The tensor-core 4-bit kernels' launches (kernels/w4_mma_gemv.py): K splits around
    the default's, with one 64-row block a program or two; for the GEMV up to its 64 rows,
    for the warpgroup kernel (wgmma: sm_90) from 9 rows; from 16 rows also the weight
    dequantized for cuBLAS (DEQUANT), which can win where the tensor-core work grows with
    the rows."""
    from slipstream.kernels.w4_mma_gemv import MAX_ROWS
    groups = k // 128
    base = default["SPLIT"]
    splits = sorted({max(1, base // 2), base, min(groups, base * 2)})
    pair = sorted({max(1, base // 4), max(1, base // 2)})
    out = []
    if m <= MAX_ROWS:
        out += [dict(NT=1, SPLIT=s) for s in splits] + [dict(NT=2, SPLIT=s) for s in pair]
    if wgmma and m > 8:     # NT tiles of WGS 64-row warpgroups a program
        # One warpgroup a tile up to 32 rows, two from 33: the best launch of every
        # Llama-3-8B shape at 16-128 rows kept to that rule on the H200 (bench_w4_mma.py,
        # results/wgmma_h200_2026-12-02), which halves the kernels compiled at start-up.
        if m <= 32:
            out += [dict(WG=True, NT=1, WGS=1, SPLIT=s) for s in splits]
            out += [dict(WG=True, NT=2, WGS=1, SPLIT=s) for s in pair]
        else:
            out += [dict(WG=True, NT=1, WGS=2, SPLIT=s) for s in pair]
            out += [dict(WG=True, NT=2, WGS=2, SPLIT=s) for s in sorted({max(1, base // 8),
                                                                          max(1, base // 4)})]
    if m >= 16:
        out.append(dict(DEQUANT=True))
    return out


def gemv_candidates(n: int, k: int, tile: int, device) -> list[dict]:
    """The weight-streaming GEMV's launches (kernels/int_weight_gemv.py): rows per program
    and warps, a K split around the one that gives about four programs an SM, the next
    tile's words loaded ahead by hand or the loop pipelined (num_stages). Few: each is a
    compile."""
    from slipstream.kernels.int_weight_gemv import default_gemv_config
    forced = os.environ.get("SLIPSTREAM_GEMV_CONFIG")   # one launch, for measurements
    if forced:
        import json
        cfg = json.loads(forced)
        if not isinstance(cfg, dict) or not {"BLOCK_N", "num_warps"} <= cfg.keys():
            raise ValueError("SLIPSTREAM_GEMV_CONFIG: a JSON object with BLOCK_N, num_warps "
                             f"(SPLIT_K, num_stages, PREFETCH optional), got {forced!r}")
        base = default_gemv_config(1, n, k, tile, device)["SPLIT_K"] * 64 // cfg["BLOCK_N"]
        split = cfg.get("SPLIT_K", max(1, base))   # by default the shape's own split
        return [{"num_stages": 1, "PREFETCH": False, **cfg,
                 "SPLIT_K": max(1, min(split, k // tile))}]
    # A sweep on the H200 (benchmarks/quant/gemv_sweep.py, 8B shapes, batch 1): 64 rows
    # and 4 warps lead on every shape, the loop unpipelined with or without the manual
    # prefetch (gate_up 37 us, 1.90x bf16; qkv 14.3, down 26.0); pipelining it cost
    # 10-20%, 128 rows unpipelined up to 2.4x; 64 rows on 2 warps or 128 on 4 pipelined
    # (3 stages) came within 4-15% and stay as fallbacks.
    out = []
    base = default_gemv_config(1, n, k, tile, device)["SPLIT_K"]
    for block_n, warps, stages, prefetch, splits in (
            (64, 4, 1, False, (1, 2)), (64, 4, 1, True, (1, 2)),
            (64, 2, 3, False, (1,)), (128, 4, 3, False, (1,))):
        for f in splits:
            split = max(1, min(32, base * 64 // block_n * f))
            if split <= k // tile:
                out.append(dict(BLOCK_N=block_n, SPLIT_K=split, num_warps=warps,
                                num_stages=stages, PREFETCH=prefetch))
    return out


def tma_int8_candidates() -> list[dict]:
    """The 8-bit TMA GEMV's launches (kernels/tma_int8_gemv.py) beside the GEMV's, at one
    row: rows a program and ring slots. Measured alone on the H200 (Llama-3-8B shapes,
    benchmarks/quant/bench_tma_int8_gemv.py), 32 rows and 6 slots led on qkv, gate_up
    and down, 16 rows and 8 slots on o_proj; only gate_up beat the GEMV there."""
    return [dict(TMA=True, BLOCK_N=bn, STAGES=st, num_warps=4, PROGRAMS=0)
            for bn, st in ((32, 6), (16, 8), (32, 8))]


def split_k_for(tiles: int, k_tiles: int, device: torch.device) -> int:
    """Split K when the output tiles alone cannot fill the GPU: aim at two programs per SM,
    keeping at least 4 K tiles per program. Always 1 off CUDA."""
    if device.type != "cuda":
        return 1
    from slipstream.kernels.runtime import num_sms
    sms = num_sms(device.index or 0)
    if tiles >= sms:
        return 1
    want = -(-2 * sms // tiles)
    return max(1, min(want, k_tiles // 4, 16))



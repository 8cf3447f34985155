"""Tile configs of the prefill kernel (prefill_attention.py) and how it fetches cached K/V.

The autotuner's candidates and their pruning, the fixed config the CPU
interpreter runs, and the paged-load modes (prefill_paged.py) with the checks
that pick one for a given pool.
"""
from __future__ import annotations

import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from slipstream.kernels.prefill_paged import PREFETCH, TMA, offsets_fit_int32, tma_pool_ok


def set_block_shapes(nargs):
    """TMA descriptors carry their tile shape, which depends on the config."""
    if isinstance(nargs["Q"], TensorDescriptor):
        nargs["Q"].block_shape = [nargs["BLOCK_M"], nargs["HEAD_DIM"]]
        nargs["K"].block_shape = [nargs["BLOCK_N"], nargs["HEAD_DIM"]]
        nargs["V"].block_shape = [nargs["BLOCK_N"], nargs["HEAD_DIM"]]
    for name in ("KCacheDesc", "VCacheDesc"):
        if isinstance(nargs.get(name), TensorDescriptor):
            nargs[name].block_shape = [nargs["BLOCK_N"], nargs["HEAD_DIM"]]
    if isinstance(nargs["OutDesc"], TensorDescriptor):
        nargs["OutDesc"].block_shape = [nargs["BLOCK_M"], nargs["HEAD_DIM"]]


def _config(bm, bn, warps, stages, ws=False, maxnreg=None, tma_store=False, paired=False):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "WARP_SPECIALIZE": ws, "TMA_STORE": tma_store,
                          "PAIRED": paired},
                         num_warps=warps, num_stages=stages, maxnreg=maxnreg, pre_hook=set_block_shapes)


# Candidates, from sweeps on an H200 (benchmarks/attention): 128x128 tiles with
# 8 warps and 3 stages lead for long prompts. 128x64 tiles in 2 stages capped at
# 128 registers fit two programs an SM (98 KB shared memory each), which hides
# each program's prologue and epilogue behind the other: +18% at 1k tokens.
# Paired causal programs (a long query block and a short one each) measured
# +0.3-2% over unpaired at 1k and 4k in each of three sweeps, -2-4% at 16k;
# the tuner picks per query-length bucket. 64x64 serves short prompts. Pruned per
# call to what fits. (WARP_SPECIALIZE stays off: on sm_90 Triton 3.6 compiles
# it to the same PTX as without.)
PREFILL_CONFIGS = [
    _config(128, 128, 8, 3),
    _config(128, 128, 8, 3, paired=True),
    _config(128, 64, 8, 2, maxnreg=128, tma_store=True, paired=True),
    _config(128, 64, 8, 2, maxnreg=128, tma_store=True),
    _config(128, 64, 8, 3),
    _config(64, 64, 4, 3),
]
SMEM_BYTES = 227 * 1024  # per block on Hopper
# SLIPSTREAM_ATTENTION_TUNE=0: this one config, no tuning at start-up (it fits every
# head size and shared-memory budget the tuned set serves).
UNTUNED_CONFIG = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}
INTERPRET_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 16, "WARP_SPECIALIZE": False, "TMA_STORE": False,
                    "PAIRED": False}


def prune_configs(configs, named_args, **kwargs):
    kwargs = {**named_args, **kwargs}  # positional arguments arrive in named_args
    max_q = 1 << kwargs["tune_key"]
    head_dim = kwargs["HEAD_DIM_PAD"]
    kept = []
    for c in configs:
        bm, bn = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]
        smem = 2 * (bm * head_dim + 2 * c.num_stages * bn * head_dim)  # Q + staged K, V
        needs_tma = c.kwargs["WARP_SPECIALIZE"] or c.kwargs["TMA_STORE"]
        if bm % bn or smem > SMEM_BYTES or (needs_tma and not kwargs["USE_TMA"]):
            continue
        if c.kwargs["PAIRED"] and not kwargs["CAUSAL"]:  # equal blocks: nothing to balance
            continue
        if bm > max(64, max_q):  # short queries: don't pay for empty rows
            continue
        kept.append(c)
    return kept or configs[-1:]


# How cached K/V tiles are fetched (prefill_paged.py): mode -> (load, int32 offsets
# wanted). "shared" is the block-table loop the decode kernel uses too; "_one_loop":
# clean and edge tiles in one pipeline (load + ONE_LOOP); "_lean": per-row address
# parts hoisted out of the loop (+ LEAN).
ONE_LOOP, LEAN = 4, 8
PAGED_LOADS = {"shared": (3, False), "gather": (0, False), "gather32": (0, True),
               "prefetch": (PREFETCH, False), "prefetch32": (PREFETCH, True), "tma": (TMA, True),
               "prefetch32_one_loop": (ONE_LOOP + PREFETCH, True),
               "tma_one_loop": (ONE_LOOP + TMA, True),
               "prefetch32_lean": (LEAN + PREFETCH, True),
               "prefetch32_one_loop_lean": (LEAN + ONE_LOOP + PREFETCH, True),
               "tma_lean": (LEAN + TMA, True)}
# Measured on an H200 (benchmarks/attention/bench_paged_prefill.py, bf16, 4 x 4k causal,
# every key cached): 16-token pages, prefetching int32 gathers 370-386 TFLOP/s in one run,
# 420-421 in another (dense 476-477 in both), against 292-313 for "shared"; 128-token
# pages, TMA tiles 475. "_lean" compiles to fewer instructions a tile (513 against 573
# for 16-token pages, sm_90) yet measured 410-422: no faster, so not the default.
PAGED_LOAD_DEFAULT = "tma"


def paged_load_args(name, k_cache, v_cache, k_cache_scale, page_size, tma_ok):
    """(load mode, OFFS32, (k, v) pool descriptors or placeholders) for `name`.
    TMA needs a Hopper GPU, an unquantized contiguous pool and, per tile config,
    a page of at least BLOCK_N tokens (checked in the kernel; else PREFETCH)."""
    name = PAGED_LOAD_DEFAULT if name is None else name
    if name not in PAGED_LOADS:
        raise ValueError(f"paged_load must be one of {sorted(PAGED_LOADS)}, got {name!r}")
    load, offs32 = PAGED_LOADS[name]
    offs32 = offs32 and offsets_fit_int32(k_cache) and (
        k_cache_scale is None or offsets_fit_int32(k_cache_scale))
    descs = (k_cache, v_cache)  # placeholders
    if load % ONE_LOOP == TMA and not (tma_ok and tma_pool_ok(k_cache) and tma_pool_ok(v_cache)):
        load += PREFETCH - TMA
    if load % ONE_LOOP == TMA:
        rows, width = k_cache.shape[0] * page_size, k_cache.shape[2] * k_cache.shape[3]
        descs = tuple(TensorDescriptor(c, [rows, width], [width, 1], [1, k_cache.shape[3]])
                      for c in (k_cache, v_cache))
    return load, offs32, descs

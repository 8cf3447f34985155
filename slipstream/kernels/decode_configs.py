"""Launch configs and split counts of the split-KV decode kernel
(decode_attention.py), and how a quantized cache meets the query there."""
from __future__ import annotations

import torch
import triton

from slipstream.kernels.attention_tile import next_pow2
from slipstream.kernels.runtime import interpreting, num_sms

# Launch configs, each with the programs that fit on one SM at it (H200: 227 KB
# shared memory, 64K registers). Decode is memory-bound: few warps, and as many
# K/V bytes in flight as fit. The block-table read feeds the K/V addresses, so
# the pipeliner keeps (num_stages - 2) // 2 + 1 K/V tiles in flight.
DEEP_CONFIG = {"BLOCK_N": 64, "num_warps": 2, "num_stages": 6}  # 2 tiles in flight, 72 KB
WIDE_CONFIG = {"BLOCK_N": 64, "num_warps": 2, "num_stages": 4}  # 1 tile, 39 KB, 240 regs: 4 an SM
# Taller tiles (several tree nodes x heads): one warpgroup, so the dots run on
# wgmma with operands in shared memory (116 KB, one program an SM).
TALL_CONFIG = {"BLOCK_N": 64, "num_warps": 4, "num_stages": 6}
# One request's tree in 16-row blocks, unsplit, 16-bit cache (the EAGLE loop's
# verification): 128-key tiles in one warpgroup. H200, SmolLM2's 61-token tree over
# 160 / 320 tokens, 30 layers' caches in a graph: 15.1 / 16.7 us a call against 17.1 /
# 19.1 with DEEP_CONFIG, best of 49 configs (benchmarks/spec/bench_tree_configs.py);
# the compiled loop round 1.396 against 1.431 ms (benchmarks/spec/README.md).
SHORT_TREE_CONFIG = {"BLOCK_N": 128, "num_warps": 4, "num_stages": 3}
# 1-byte (int8 / fp8) caches: a 128-key tile moves the bytes of a 64-key 16-bit
# one. Compiled for sm_90 (benchmarks/attention/compile_report.py --kv int8):
# 128 keys, 4 warps, 6 stages keep two such tiles in flight like DEEP (77 KB,
# 226 registers, no spills, two programs an SM); for many programs, 64 keys in
# 2 warps keep two 16 KB tiles in flight at five programs an SM (168 registers,
# 32 bytes of stack). Chosen from the compiled code, not yet timed:
# benchmarks/quant/bench_kv_cache.py sweeps them on the device.
QUANT_DEEP_CONFIG = {"BLOCK_N": 128, "num_warps": 4, "num_stages": 6}
QUANT_WIDE_CONFIG = {"BLOCK_N": 64, "num_warps": 2, "num_stages": 6}
# Programs per SM in the one wave the split count aims for. Three DEEP programs
# fit, but two stream faster (H200, B=1 L=32k: 84% of copy bandwidth at 33
# splits against 80% at 49, benchmarks/attention).
DEEP_PER_SM, TALL_PER_SM = 2, 1
INTERPRET_CONFIG = {"BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
MIN_TOKENS_PER_SPLIT = 128
# Contexts this short run unsplit: the whole attention is a few microseconds,
# less than launching the merge kernel costs the host.
UNSPLIT_MAX_LEN = 512
MAX_SPLITS = 64
# Unsplit decode steps whose contexts are all at most this long take the
# short-context kernel (short_decode_attention.py): one program per (request,
# KV head), no merge. A power of two >= 512, so that a captured graph's context
# class (runner/cuda_graph.py) is wholly on one side.
SHORT_MAX_LEN = 512
MAX_TREE_NODES = 64  # one int64 bitmask per node
# How a quantized cache meets the query: 0 codes -> the query's dtype
# (attention_tile.py), 1 codes -> fp16 operands, 2 the same with V read as 16-bit
# words, 3 as 2 with int8 K codes dotted with the query split in two int8 halves
# (int8 caches; fp8 ones take 2) (code_tile.py). Measured (H200, bench_kv_cache.py
# --quick, results/kv_decode_quick_h200_2026-11-30.md), decode vs the bf16 cache,
# B=1 32k / 128k, B=32 4k: int8 path 0 0.96x / 1.06x / 0.96x, path 3 1.39x / 1.65x
# / 1.66x (path 2 1.34x / 1.50x); fp8 path 0 0.84x / 0.90x / 0.83x, path 2 1.45x /
# 1.69x / 1.67x.
DEFAULT_KV_DOT = {"int8": 3, "fp8": 2}
# Keys of its share a split prefetches into L2 before it waits on the kernel
# before it (attention_tile.prefetch_paged_keys). Off: 128 keys measured slower
# for every cache and context in the same run (B=1 32k: bf16 38.7 against 37.4 us,
# int8 27.3 against 27.0, fp8 26.9 against 25.8).
DEFAULT_PREFETCH = 0


# The most rows (query token x head in group) a program of the split kernel takes;
# taller steps (tree verification) are cut into row blocks of this many (16: 2-warp
# programs, DEEP / WIDE configs; more: 4-warp TALL ones). 0: 64, or 16 where 64-row
# blocks would leave most SMs idle (fewer programs than FEW_PROGRAMS_SHARE of them):
# one request's tree of 61 tokens on SmolLM2 (3 KV heads, 9 programs) verified
# 1.7% faster a round in 16-row blocks (H200, benchmarks/spec/README.md).
MAX_BLOCK_M = 0
FEW_PROGRAMS_SHARE = 0.5
# The launch config of tree steps (tree verification), "BLOCK_NxWARPSxSTAGES" (e.g.
# "32x4x3"), or "" for the rule below; for A/B runs (benchmarks/spec/bench_tree_configs.py).
TREE_CONFIG = ""


def parse_launch(text: str) -> dict:
    """'BLOCK_NxWARPSxSTAGES' -> a launch config."""
    try:
        bn, w, st = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"a launch config is BLOCK_NxWARPSxSTAGES, e.g. 64x2x6, got {text!r}") from None
    return {"BLOCK_N": bn, "num_warps": w, "num_stages": st}


def _tile_rows(max_query_len: int, group: int, num_seqs: int = 1,
               num_kv_heads: int = 1) -> tuple[int, int]:
    """(BLOCK_M, row blocks per KV head): rows are query token x head in group."""
    rows = max_query_len * group
    cap = MAX_BLOCK_M
    if not cap:
        few = num_seqs * num_kv_heads * triton.cdiv(rows, 64) < FEW_PROGRAMS_SHARE * _sm_count()
        cap = 16 if few else 64
    block_m = max(16, min(next_pow2(rows), cap))
    return block_m, triton.cdiv(rows, block_m)


def _sm_count() -> int:
    """SMs of the GPU (132, an H100 / H200's, without one: CPU tests)."""
    return num_sms() if torch.cuda.is_available() else 132


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, *,
                      max_query_len: int = 1, group: int = 1, sm_count: int | None = None) -> int:
    """Splits per (request, KV head): as many as fill one wave of program slots
    (a second, partial wave costs a whole split's time), without splits shorter
    than MIN_TOKENS_PER_SPLIT; none for contexts up to UNSPLIT_MAX_LEN."""
    if max_seq_len <= UNSPLIT_MAX_LEN:
        return 1
    if sm_count is None:
        sm_count = _sm_count()
    block_m, row_blocks = _tile_rows(max_query_len, group, num_seqs, num_kv_heads)
    programs = max(num_seqs * num_kv_heads * row_blocks, 1)
    per_sm = DEEP_PER_SM if block_m <= 16 else TALL_PER_SM
    want = max(per_sm * sm_count // programs, 1)
    useful = triton.cdiv(max_seq_len, MIN_TOKENS_PER_SPLIT)
    return min(want, useful, MAX_SPLITS)


def _launch_config(block_m: int, programs: int, device, quant: bool = False,
                   tree: bool = False, splits: int = 1) -> dict:
    if interpreting():
        return INTERPRET_CONFIG
    if tree and TREE_CONFIG:
        return parse_launch(TREE_CONFIG)
    if tree and block_m <= 16 and splits == 1 and not quant:
        return SHORT_TREE_CONFIG
    if block_m > 16:
        return TALL_CONFIG
    # More programs than one wave of deep ones: the shallower config fits more.
    one_wave = programs <= DEEP_PER_SM * num_sms(device.index or 0)
    if quant:
        return QUANT_DEEP_CONFIG if one_wave else QUANT_WIDE_CONFIG
    return DEEP_CONFIG if one_wave else WIDE_CONFIG


def default_kv_dot(cache_dtype: torch.dtype, block_m: int) -> int:
    """The quantized path (KV_DOT) for a cache of `cache_dtype` and row tiles of
    block_m. Tall tiles (tree verification) keep the codes -> query dtype path:
    the fp16 one spills more registers there (sm_90: 152-232 bytes of stack
    against 88-96), and only decode tiles have been timed."""
    if block_m > 16:
        return 0
    return DEFAULT_KV_DOT["int8" if cache_dtype == torch.int8 else "fp8"]

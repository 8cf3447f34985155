"""One launch of each attention kernel inside a profiler range, for Nsight Compute:

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \\
        python benchmarks/attention/profile_kernels.py

Kernels are compiled and warmed up first, so only the launches below are profiled:
prefill 16k and 4k causal (bf16, hdim 128, 16 heads), decode B=1 L=32k and
B=64 L=4k (GQA 32/8, page 16) and tree verification (16 x 4k context, 16 nodes),
prefill with 128x128 tiles, the rest with the configs their launchers choose.
"""
from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE)]

import torch  # noqa: E402

from decode_cases import HEAD_DIM, HEADS, KV_HEADS, PAGE, SCALE  # noqa: E402
from slipstream.kernels.decode_attention import (  # noqa: E402
    choose_num_splits, decode_attention, split_kv_scratch)
from slipstream.kernels.prefill_attention import prefill_attention  # noqa: E402
from slipstream.kernels.tree_attention import ancestor_mask, tree_attention  # noqa: E402
from timing import cu_seqlens, paged_copy  # noqa: E402

PREFILL_CONFIG = {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3}


def prefill_call(n: int, heads: int = 16, tokens: int = 16384):
    q, k, v = (torch.randn(tokens, heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    b = tokens // n
    cache = torch.empty(1, 16, heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    ctx = torch.zeros(b, dtype=torch.int32, device="cuda")
    tables = torch.zeros(b, 1, dtype=torch.int32, device="cuda")
    cu = cu_seqlens([n] * b, "cuda")
    out = torch.empty_like(q)
    return lambda: prefill_attention(q, k, v, cache, cache, cu, ctx, tables, n, SCALE,
                                     out=out, config=PREFILL_CONFIG)


def decode_call(b: int, length: int):
    k = torch.randn(b, length, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    k_cache, v_cache, tables = paged_copy(k, v, PAGE, torch.Generator().manual_seed(0))
    del k, v
    q = torch.randn(b, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    seq_lens = torch.full((b,), length, dtype=torch.int32, device="cuda")
    splits = choose_num_splits(b, KV_HEADS, length, group=HEADS // KV_HEADS)
    scratch = split_kv_scratch(b, HEADS, splits, HEAD_DIM, "cuda") if splits > 1 else None
    out = torch.empty_like(q)
    cu = torch.arange(b + 1, dtype=torch.int32, device="cuda")
    return lambda: decode_attention(q, k_cache, v_cache, seq_lens, tables, SCALE, max_seq_len=length,
                                    num_splits=splits, cu_seqlens_q=cu, out=out, scratch=scratch)


def tree_call(b: int = 16, ctx: int = 4096, nodes: int = 16):
    length = ctx + nodes
    k = torch.randn(b, length, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k_cache, v_cache, tables = paged_copy(k, torch.randn_like(k), PAGE, torch.Generator().manual_seed(0))
    del k
    q = torch.randn(b * nodes, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    masks = ancestor_mask([-1] + list(range(nodes - 1))).expand(b, nodes, nodes).contiguous().cuda()
    cu = torch.arange(0, b * nodes + 1, nodes, dtype=torch.int32, device="cuda")
    seq_lens = torch.full((b,), length, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    return lambda: tree_attention(q, k_cache, v_cache, cu, seq_lens, tables, masks, SCALE,
                                  max_query_len=nodes, max_seq_len=length, out=out)


def main() -> None:
    calls = [prefill_call(16384), prefill_call(4096), decode_call(1, 32768), decode_call(64, 4096),
             tree_call()]
    for c in calls:  # compile and warm up outside the profiled range
        c()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for c in calls:
        c()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()

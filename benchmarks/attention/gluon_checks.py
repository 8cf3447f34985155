"""Variants of the Gluon prefill kernel and their correctness checks.

Run as a child of bench_gluon_prefill.py (`python gluon_checks.py NAME...`):
one JSON line per variant on stdout, flushed as soon as it is known, so a
variant that hangs (a barrier phase gone wrong) is found by the parent's
timeout and skipped, and the others still run. With --compile-only (no GPU)
each variant is compiled for sm_90 instead and its PTX summarised.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT)]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

_BASE = {"BLOCK_M": 128, "BLOCK_N": 128, "STAGES": 2, "WS": False, "PINGPONG": False,
         "TURNS": True, "PERSISTENT": False, "Q_BUFS": 2, "PIN": True, "num_warps": 8}
_PP = {**_BASE, "WS": True, "PINGPONG": True, "num_warps": 4}
# Smem: Q 32 KB + STAGES * (K + V) tiles (32 KB each at BLOCK_N 128); 227 KB at most.
# The first H200 run (benchmarks/attention/GLUON.md) dropped BLOCK_M 64 and the
# non-WS BLOCK_N 64 variants (the slowest) and put ping-pong with 3 stages first.
VARIANTS = {
    "m128_n128_s2": _BASE,
    "m128_n128_s2_unpinned": {**_BASE, "PIN": False},  # ptxas's own wait placement, for comparison
    "m128_n128_s3": {**_BASE, "STAGES": 3},
    "ws_m128_n128_s2": {**_BASE, "WS": True},
    "ws_m128_n128_s3": {**_BASE, "WS": True, "STAGES": 3},
    "pingpong_n128_s2": _PP,
    "pingpong_n128_s3": {**_PP, "STAGES": 3},
    "pingpong_n64_s4": {**_PP, "BLOCK_N": 64, "STAGES": 4},
    "pingpong_n64_s6": {**_PP, "BLOCK_N": 64, "STAGES": 6},
    "pingpong_n128_s2_unpinned": {**_PP, "PIN": False},
    "pingpong_n128_s3_unpinned": {**_PP, "STAGES": 3, "PIN": False},
    "two_consumers_n128_s3": {**_PP, "STAGES": 3, "TURNS": False},  # two 4-warp consumers, no turns
    # Persistent (one program per SM, Q double-buffered: 64 KB + the K/V ring; _q1: 32 KB).
    "ws_persistent_n128_s2": {**_BASE, "WS": True, "PERSISTENT": True},
    "pingpong_persistent_n128_s2": {**_PP, "PERSISTENT": True},
    "pingpong_persistent_n64_s4": {**_PP, "PERSISTENT": True, "BLOCK_N": 64, "STAGES": 4},
    "pingpong_persistent_n64_s5": {**_PP, "PERSISTENT": True, "BLOCK_N": 64, "STAGES": 5},
    "two_consumers_persistent_n128_s2": {**_PP, "TURNS": False, "PERSISTENT": True},
    "pingpong_persistent_n128_s3_q1": {**_PP, "PERSISTENT": True, "STAGES": 3, "Q_BUFS": 1},
    # Work order (gluon_schedule.py; its twin puts the busiest persistent program at 4x4k causal
    # 1.12x the mean tiles in the order above, 1.03x snake, 1.003x snake + LPT; at 16k 1.56x,
    # 1.53x, 1.001x). lpt: longest blocks of all heads first; g2: two heads at a time.
    "pingpong_persistent_n128_s2_snake": {**_PP, "PERSISTENT": True, "SNAKE": True},
    "pingpong_persistent_n128_s3_q1_snake": {**_PP, "PERSISTENT": True, "SNAKE": True, "STAGES": 3,
                                             "Q_BUFS": 1},
    "pingpong_persistent_n128_s2_snake_g2": {**_PP, "PERSISTENT": True, "SNAKE": True, "HEAD_GROUP": 2},
    "pingpong_persistent_n128_s2_lpt": {**_PP, "PERSISTENT": True, "SNAKE": True, "HEAD_GROUP": 4096},
    "pingpong_n128_s2_lpt": {**_PP, "HEAD_GROUP": 4096},
    # table: the non-empty items only, longest first, from the host's request lengths
    "pingpong_n128_s2_table": {**_PP, "TABLE": True},
    "pingpong_persistent_n128_s2_table": {**_PP, "PERSISTENT": True, "SNAKE": True, "TABLE": True},
    # three consumer warpgroups (BLOCK_M 192, no turns; 64-key tiles: 128-key ones spill at
    # the 152 registers a consumer 13 warps leave), two-consumer 64-key tiles as the control
    "three_consumers_n64_s4": {**_PP, "BLOCK_M": 192, "TURNS": False, "BLOCK_N": 64, "STAGES": 4},
    "three_consumers_persistent_n64_s3_snake": {**_PP, "BLOCK_M": 192, "TURNS": False, "BLOCK_N": 64,
                                                "STAGES": 3, "PERSISTENT": True, "SNAKE": True},
    "two_consumers_n64_s4": {**_PP, "TURNS": False, "BLOCK_N": 64, "STAGES": 4},
    # the softmax's row max and sum by pairwise halving (gluon_attention_tile.row_reduce)
    "pingpong_n128_s2_tree": {**_PP, "TREE": True},
    "pingpong_persistent_n128_s2_snake_tree": {**_PP, "PERSISTENT": True, "SNAKE": True, "TREE": True},
    # K_j released beside V_{j-1} (one warpgroup sync a tile fewer; gluon_attention_tile)
    "pingpong_n128_s2_latek": {**_PP, "LATE_K": True},
    "pingpong_persistent_n128_s2_snake_latek": {**_PP, "PERSISTENT": True, "SNAKE": True, "LATE_K": True},
}
# What one run times by default (about 60 s on the H200); the others by --variants.
DEFAULT_RUN = ["m128_n128_s3", "ws_m128_n128_s2", "ws_m128_n128_s3", "pingpong_n128_s2",
               "pingpong_n128_s3", "pingpong_n128_s3_unpinned", "two_consumers_n128_s3",
               "ws_persistent_n128_s2", "pingpong_persistent_n128_s2",
               "pingpong_persistent_n128_s3_q1", "two_consumers_persistent_n128_s2"]
# (request lengths, heads, kv_heads, causal, dtype, head_dim): ragged ends, GQA
# and MQA, one-token and one-tile-plus-one requests, full blocks (bulk stores) and
# partial ones, SmolLM2's 9/3 heads of 64; four compiles a variant.
CASES = [([1, 63, 128, 129, 700, 1500, 2048], 16, 4, True, torch.bfloat16, 128),
         ([5, 256, 1000, 64, 333, 4096], 8, 1, False, torch.bfloat16, 128),
         ([77, 1024, 2000], 8, 8, True, torch.float16, 128),
         ([100, 1000, 2048], 9, 3, True, torch.bfloat16, 64)]
# Relative (Frobenius) error, and the largest absolute one: a few wrong rows
# (a request's ragged end) hardly move the first but show in the second.
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3}
MAX_ABS = {torch.bfloat16: 5e-2, torch.float16: 1e-2}


def reference(q, k, v, cu, causal, scale):
    """Per request, fp32 SDPA with K/V heads repeated for GQA."""
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[1]
    starts = cu.tolist()
    for a, e in zip(starts[:-1], starts[1:]):
        qs, ks, vs = (x[a:e].transpose(0, 1).float() for x in (q, k, v))
        ks, vs = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)
        out[a:e] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal,
                                                  scale=scale).transpose(0, 1).to(q.dtype)
    return out


def rel_err(out, ref) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm()).item()


_DATA: dict = {}  # case -> (q, k, v, cu, reference): shared by every variant


def _case_data(i: int):
    if i not in _DATA:
        lengths, heads, kv_heads, causal, dtype, dim = CASES[i]
        gen = torch.Generator(device="cuda").manual_seed(i)
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
        q = torch.randn(sum(lengths), heads, dim, device="cuda", dtype=dtype, generator=gen)
        k, v = (torch.randn(sum(lengths), kv_heads, dim, device="cuda", dtype=dtype, generator=gen)
                for _ in range(2))
        _DATA[i] = (q, k, v, cu, reference(q, k, v, cu, causal, dim ** -0.5))
    return _DATA[i]


def check_variant(cfg: dict) -> dict:
    """Errors per case (over TOLERANCE or MAX_ABS fails); the output starts as
    NaN, so rows the kernel never wrote show."""
    from slipstream.kernels.gluon_prefill import gluon_prefill
    worst, errs = 0.0, {}
    for i, (lengths, heads, kv_heads, causal, dtype, dim) in enumerate(CASES):
        q, k, v, cu, ref = _case_data(i)
        out = torch.full_like(q, float("nan"))
        gluon_prefill(q, k, v, cu, max(lengths), dim ** -0.5, causal=causal, out=out, config=cfg,
                      lengths=lengths)
        err = rel_err(out, ref)
        max_abs = (out.float() - ref.float()).abs().max().item() if err != float("inf") else err
        name = f"{len(lengths)}seqs_h{heads}/{kv_heads}x{dim}_{'causal' if causal else 'full'}_{str(dtype)[6:]}"
        errs[name] = err
        errs[name + "_max_abs"] = max_abs
        worst = max(worst, err / TOLERANCE[dtype], max_abs / MAX_ABS[dtype])
    return {"ok": worst <= 1.0, "errors": errs}


def compile_variant(cfg: dict) -> dict:
    from slipstream.kernels.gluon_compile import compile_prefill, overlap_report, sass_overlap
    k = compile_prefill(cfg)
    return {"ok": True, "shared_bytes": k.metadata.shared, **overlap_report(k.asm["ptx"]),
            "sass_exp2_under_pv": sass_overlap(k.asm["cubin"])}


def main(names: list[str], compile_only: bool) -> None:
    for name in names:
        print(json.dumps({"start": name}), flush=True)
        t0 = time.time()
        try:
            res = (compile_variant if compile_only else check_variant)(VARIANTS[name])
            if not compile_only:  # what it compiles to, for the report (ptxas may move waits)
                try:
                    res["compiled"] = compile_variant(VARIANTS[name])
                except Exception as e:
                    res["compiled"] = f"{type(e).__name__}: {str(e)[-200:]}"
        except Exception as e:  # a variant that does not compile or launch is a result too
            res = {"ok": False, "error": f"{type(e).__name__}: {str(e)[-600:]}"}
        res["seconds"] = round(time.time() - t0, 2)
        print(json.dumps({"name": name, **res}), flush=True)
        if not res["ok"] and not compile_only:
            return  # a fault may have poisoned the CUDA context: the parent restarts on the rest


if __name__ == "__main__":
    args = sys.argv[1:]
    main([a for a in args if not a.startswith("--")], "--compile-only" in args)

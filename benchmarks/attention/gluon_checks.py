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

_BASE = {"BLOCK_M": 128, "BLOCK_N": 128, "STAGES": 2, "WS": False, "PINGPONG": False, "num_warps": 8}
_PP = {**_BASE, "WS": True, "PINGPONG": True, "num_warps": 4}
# Smem: Q 32 KB + STAGES * (K + V) tiles (32 KB each at BLOCK_N 128); 227 KB at most.
VARIANTS = {
    "m128_n128_s2": _BASE,
    "m128_n128_s3": {**_BASE, "STAGES": 3},
    "m128_n64_s4": {**_BASE, "BLOCK_N": 64, "STAGES": 4},
    "m64_n64_s2_w4": {**_BASE, "BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4},
    "m64_n128_s2_w4": {**_BASE, "BLOCK_M": 64, "num_warps": 4},
    "ws_m128_n128_s2": {**_BASE, "WS": True},
    "ws_m128_n128_s3": {**_BASE, "WS": True, "STAGES": 3},
    "ws_m128_n64_s4": {**_BASE, "WS": True, "BLOCK_N": 64, "STAGES": 4},
    "pingpong_n128_s2": _PP,
    "pingpong_n128_s3": {**_PP, "STAGES": 3},
    "pingpong_n64_s4": {**_PP, "BLOCK_N": 64, "STAGES": 4},
}
# (request lengths, heads, kv_heads, causal): ragged ends, GQA, one-token and
# one-tile-plus-one requests, full blocks (bulk stores) and partial ones.
CASES = [([1, 63, 128, 129, 700, 1500], 16, 4, True),
         ([5, 256, 1000, 64], 8, 8, False),
         ([2048, 2048], 16, 16, True),
         ([333, 4096], 4, 1, False)]
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3}


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


def check_variant(cfg: dict) -> dict:
    """Worst relative error over CASES x {bf16, fp16}; NaN-filled outputs show
    rows the kernel never wrote."""
    from slipstream.kernels.gluon_prefill import gluon_prefill
    gen = torch.Generator(device="cuda").manual_seed(0)
    worst, errs = 0.0, {}
    for lengths, heads, kv_heads, causal in CASES:
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
        tokens = sum(lengths)
        for dtype in TOLERANCE:
            q = torch.randn(tokens, heads, 128, device="cuda", dtype=dtype, generator=gen)
            k, v = (torch.randn(tokens, kv_heads, 128, device="cuda", dtype=dtype, generator=gen)
                    for _ in range(2))
            out = torch.full_like(q, float("nan"))
            gluon_prefill(q, k, v, cu, max(lengths), 128 ** -0.5, causal=causal, out=out, config=cfg)
            err = rel_err(out, reference(q, k, v, cu, causal, 128 ** -0.5))
            key = f"{len(lengths)}seqs_h{heads}/{kv_heads}_{'causal' if causal else 'full'}_{str(dtype)[6:]}"
            errs[key] = err
            worst = max(worst, err / TOLERANCE[dtype])
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
        except Exception as e:  # a variant that does not compile or launch is a result too
            res = {"ok": False, "error": f"{type(e).__name__}: {str(e)[-600:]}"}
        res["seconds"] = round(time.time() - t0, 2)
        print(json.dumps({"name": name, **res}), flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    main([a for a in args if not a.startswith("--")], "--compile-only" in args)

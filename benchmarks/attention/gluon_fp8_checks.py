"""Variants of the FP8 Gluon prefill kernel and their correctness checks.

Run as a child of bench_gluon_fp8.py (`python gluon_fp8_checks.py NAME...`), the
protocol of gluon_checks.py: one JSON line per variant, flushed at once, so a
hang is found by the parent's timeout. A variant passes when, on every case,
its output is within ERROR_BOUND of fp32 attention of the unquantised inputs
(the stated error bound of the FP8 path) AND within TWIN_BOUND / TWIN_MAX_ABS of
its PyTorch twin (gluon_fp8_inputs.emulate_fp8_prefill: the same quantised
inputs and e4m3 P, so a wrong scale or tile shows there far beyond rounding).
The pseudo-variant "triton_fp8_path" reports the existing Triton FP8 path's and
the bf16 Gluon kernel's errors on the same cases (for the error comparison).
--compile-only (no GPU): compile for sm_90 instead.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402

from gluon_checks import reference, rel_err  # noqa: E402

ERROR_BOUND = 8e-2   # relative (Frobenius) against fp32 attention (H200: 4.8-5.4e-2 dense, twin 4.7e-2)
TWIN_BOUND = 1e-2    # relative against the twin (bf16 output rounding: 1.6e-3)
TWIN_MAX_ABS = 0.25  # largest absolute difference to the twin: one P value rounded to the next e4m3
#   step (6-12%) in a row of few keys moves its output by up to ~0.1 (H200: 0.079, rel 3.6e-3);
#   a wrong scale or tile gives O(1)
_BASE = {"BLOCK_M": 128, "BLOCK_N": 128, "STAGES": 2, "PERSISTENT": False, "Q_BUFS": 2, "PIN": True,
         "SNAKE": False, "HEAD_GROUP": 0, "TURNS": True, "num_warps": 4}  # names without _perm:
# V^T in the keys' order (KEY_PERM False), as before it existed
# Shared memory: Q 16 KB a buffer, K + V^T 32 KB a stage at BLOCK_N 128.
VARIANTS = {
    "fp8_s2": _BASE,
    "fp8_s3": {**_BASE, "STAGES": 3},
    "fp8_s4": {**_BASE, "STAGES": 4},
    "fp8_s2_unpinned": {**_BASE, "PIN": False},
    "fp8_n64_s4": {**_BASE, "BLOCK_N": 64, "STAGES": 4},
    "fp8_persistent_s2": {**_BASE, "PERSISTENT": True},
    "fp8_persistent_s3": {**_BASE, "PERSISTENT": True, "STAGES": 3},
    "fp8_persistent_s4": {**_BASE, "PERSISTENT": True, "STAGES": 4},
    # work orders (gluon_schedule.py, gluon_checks.py)
    "fp8_persistent_s2_snake": {**_BASE, "PERSISTENT": True, "SNAKE": True},
    "fp8_persistent_s3_snake": {**_BASE, "PERSISTENT": True, "SNAKE": True, "STAGES": 3},
    "fp8_persistent_s4_snake": {**_BASE, "PERSISTENT": True, "SNAKE": True, "STAGES": 4},
    "fp8_persistent_s2_lpt": {**_BASE, "PERSISTENT": True, "SNAKE": True, "HEAD_GROUP": 4096},
    "fp8_persistent_s3_lpt": {**_BASE, "PERSISTENT": True, "SNAKE": True, "HEAD_GROUP": 4096, "STAGES": 3},
    "fp8_s2_lpt": {**_BASE, "HEAD_GROUP": 4096},
    "fp8_s2_table": {**_BASE, "TABLE": True},
    # without ping-pong turns: each warpgroup issues its (short, FP8) GEMMs when ready
    "fp8_s2_noturns": {**_BASE, "TURNS": False},
    "fp8_persistent_s2_snake_noturns": {**_BASE, "PERSISTENT": True, "SNAKE": True, "TURNS": False},
    "fp8_persistent_s2_table": {**_BASE, "PERSISTENT": True, "SNAKE": True, "TABLE": True},
    # P.V's operand without shuffles (KEY_PERM: V^T's tokens stored in the order P's
    # registers hold them; an input layout, not a config)
    "fp8_s2_perm": {**_BASE, "KEY_PERM": True},
    "fp8_s2_noturns_perm": {**_BASE, "TURNS": False, "KEY_PERM": True},
    "fp8_persistent_s2_snake_perm": {**_BASE, "PERSISTENT": True, "SNAKE": True, "KEY_PERM": True},
    "fp8_persistent_s2_snake_noturns_perm": {**_BASE, "PERSISTENT": True, "SNAKE": True, "TURNS": False,
                                             "KEY_PERM": True},
    # 64-key tiles, the control of the three-consumer run (GLUON_FP8.md)
    "fp8_n64_s4_noturns_perm": {**_BASE, "BLOCK_N": 64, "STAGES": 4, "TURNS": False, "KEY_PERM": True},
    # the softmax's row max and sum by pairwise halving (gluon_attention_tile.row_reduce)
    "fp8_s2_noturns_tree": {**_BASE, "TURNS": False, "TREE": True},
    "fp8_persistent_s2_snake_noturns_tree": {**_BASE, "PERSISTENT": True, "SNAKE": True, "TURNS": False,
                                             "TREE": True},
    # K_j released beside V_{j-1} (one warpgroup sync a tile fewer; gluon_fp8_tile)
    "fp8_s2_noturns_latek": {**_BASE, "TURNS": False, "LATE_K": True},
    "fp8_persistent_s2_snake_noturns_latek": {**_BASE, "PERSISTENT": True, "SNAKE": True, "TURNS": False,
                                              "LATE_K": True},
    # QK^T-only FP8 (the existing path's split: V and P.V in bf16), for its error
    "qk8_s2": {**_BASE, "FP8_V": False},
    "qk8_persistent_s2_lpt": {**_BASE, "PERSISTENT": True, "SNAKE": True, "HEAD_GROUP": 4096, "FP8_V": False},
    "qk8_persistent_s2_snake": {**_BASE, "PERSISTENT": True, "SNAKE": True, "FP8_V": False},
}
DEFAULT_RUN = ["fp8_s2", "fp8_s2_noturns", "fp8_persistent_s2_snake", "fp8_persistent_s2_snake_noturns",
               "fp8_s2_perm", "fp8_s2_noturns_perm", "fp8_persistent_s2_snake_perm",
               "fp8_persistent_s2_snake_noturns_perm", "fp8_s3", "fp8_persistent_s2_lpt", "fp8_s2_table",
               "qk8_s2", "qk8_persistent_s2_snake"]


def kernel_config(name: str) -> tuple[dict, bool, bool]:
    """(the kernel's config, whether V is FP8, whether V^T's tokens are in KEY_PERM order)
    of a variant."""
    cfg = dict(VARIANTS[name])
    return cfg, cfg.pop("FP8_V", True), cfg.pop("KEY_PERM", False)
# (request lengths, heads, kv_heads, causal, out dtype, head_dim): ragged ends, GQA, MQA,
# one-token and one-tile-plus-one requests, hdim 64 (SmolLM2's 9/3 heads), fp16 output.
CASES = [([1, 63, 128, 129, 700, 1500, 2048], 16, 4, True, torch.bfloat16, 128),
         ([5, 256, 1000, 64, 333, 4096], 8, 1, False, torch.bfloat16, 128),
         ([77, 1024, 2000], 8, 8, True, torch.float16, 128),
         ([100, 1000, 2048], 9, 3, True, torch.bfloat16, 64)]
_DATA: dict = {}


def case_data(i: int, fp8_v: bool = True, key_perm: bool = False):
    """(q, k, v bf16, cu, fp32 reference, Fp8Inputs) of case i, shared by every variant."""
    from slipstream.kernels.gluon_fp8_inputs import quantize_fp8_inputs
    if (i, fp8_v, key_perm) not in _DATA:
        lengths, heads, kv_heads, causal, _, dim = CASES[i]
        gen = torch.Generator(device="cuda").manual_seed(i)
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
        q = torch.randn(sum(lengths), heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
        k, v = (torch.randn(sum(lengths), kv_heads, dim, device="cuda", dtype=torch.bfloat16,
                            generator=gen) for _ in range(2))
        ref = reference(q.float(), k.float(), v.float(), cu, causal, dim ** -0.5)
        _DATA[i, fp8_v, key_perm] = (q, k, v, cu, ref, quantize_fp8_inputs(q, k, v, cu, fp8_v=fp8_v,
                                                                           key_perm=key_perm))
    return _DATA[i, fp8_v, key_perm]


def _name(lengths, heads, kv_heads, causal, dtype, dim) -> str:
    return f"{len(lengths)}seqs_h{heads}/{kv_heads}x{dim}_{'causal' if causal else 'full'}_{str(dtype)[6:]}"


def check_variant(name: str) -> dict:
    """Errors per case; the output starts as NaN, so rows never written show."""
    from slipstream.kernels.gluon_fp8_inputs import emulate_fp8_prefill
    from slipstream.kernels.gluon_fp8_prefill import gluon_fp8_prefill
    cfg, fp8_v, key_perm = kernel_config(name)
    worst, errs = 0.0, {}
    for i, (lengths, heads, kv_heads, causal, dtype, dim) in enumerate(CASES):
        q, k, v, cu, ref, x = case_data(i, fp8_v, key_perm)
        if not fp8_v and dtype != torch.bfloat16:  # P.V in v's dtype: the output's here
            x = x._replace(v=x.v.to(dtype))
        out = torch.full(q.shape, float("nan"), dtype=dtype, device="cuda")
        gluon_fp8_prefill(x, cu, max(lengths), dim ** -0.5, causal=causal, out=out, config=cfg,
                          lengths=lengths)
        twin = emulate_fp8_prefill(x, cu, dim ** -0.5, causal=causal, block_n=cfg["BLOCK_N"])
        name = _name(lengths, heads, kv_heads, causal, dtype, dim)
        errs[name] = rel_err(out, ref)
        errs[name + "_vs_twin"] = rel_err(out, twin)
        errs[name + "_vs_twin_max_abs"] = (out.float() - twin).abs().max().item() \
            if errs[name] != float("inf") else float("inf")
        worst = max(worst, errs[name] / ERROR_BOUND, errs[name + "_vs_twin"] / TWIN_BOUND,
                    errs[name + "_vs_twin_max_abs"] / TWIN_MAX_ABS)
    return {"ok": worst <= 1.0, "errors": errs}


def baseline_errors() -> dict:
    """The existing Triton FP8 path's and the bf16 Gluon kernel's errors on the cases."""
    from slipstream.kernels.fp8_attention import fp8_prefill_attention
    from slipstream.kernels.gluon_prefill import gluon_prefill
    errs = {}
    for i, (lengths, heads, kv_heads, causal, dtype, dim) in enumerate(CASES):
        q, k, v, cu, ref, _ = case_data(i)
        name = _name(lengths, heads, kv_heads, causal, dtype, dim)
        errs["triton_fp8 " + name] = rel_err(
            fp8_prefill_attention(q, k, v, cu, max(lengths), dim ** -0.5, causal=causal), ref)
        errs["gluon_bf16 " + name] = rel_err(gluon_prefill(q, k, v, cu, max(lengths), dim ** -0.5,
                                                           causal=causal), ref)
    return {"ok": True, "errors": errs}


def outlier_accuracy(dev: str, log, fp8_ok: bool = True, qk8_ok: bool = True) -> dict:
    """prefill_cases.fp8's data (4 x 4k causal, 0.1% outliers) against float64 attention;
    the FP8 Gluon modes only if their variants passed their checks (fp8_ok, qk8_ok)."""
    import torch
    import torch.nn.functional as F
    from timing import cu_seqlens
    from slipstream.kernels.fp8_attention import fp8_prefill_attention
    from slipstream.kernels.fp8_quantize import quantize_fp8_inputs_fused
    from slipstream.kernels.gluon_fp8_inputs import quantize_fp8_inputs
    from slipstream.kernels.gluon_fp8_prefill import gluon_fp8_prefill
    from slipstream.kernels.gluon_prefill import gluon_prefill
    b, n = (4, 4096) if dev == "cuda" else (2, 200)
    heads, dim = 16, 128
    scale = dim ** -0.5
    gen = torch.Generator(device=dev).manual_seed(3)

    def draw():
        x = torch.randn(b * n, heads, dim, device=dev, generator=gen)
        outliers = torch.rand(x.shape, device=dev, generator=gen) < 1e-3
        return torch.where(outliers, 10 * torch.randn(x.shape, device=dev, generator=gen), x)
    q32, k32, v32 = draw(), draw(), draw()
    q, k, v = (t.to(torch.bfloat16) for t in (q32, k32, v32))
    cu = cu_seqlens([n] * b, dev)
    qb, kb, vb = (t.double().view(b, n, heads, dim).transpose(1, 2) for t in (q32, k32, v32))
    exact = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale)
    exact = exact.transpose(1, 2).reshape(b * n, heads, dim)
    row = {"data": f"{b} x {n} causal, N(0,1) with 0.1% of entries from N(0, 10^2)"}
    runs = {"gluon_bf16": lambda: gluon_prefill(q, k, v, cu, n, scale),
            "triton_fp8": lambda: fp8_prefill_attention(q, k, v, cu, n, scale),
            "triton_fp8_unrotated": lambda: fp8_prefill_attention(q, k, v, cu, n, scale, rotate=False),
            "gluon_fp8": lambda: gluon_fp8_prefill(quantize_fp8_inputs(q, k, v, cu), cu, n, scale),
            "gluon_fp8_unrotated": lambda: gluon_fp8_prefill(quantize_fp8_inputs(q, k, v, cu, rotate=False),
                                                             cu, n, scale),
            "gluon_fp8_fused_quantiser": lambda: gluon_fp8_prefill(
                quantize_fp8_inputs_fused(q, k, v, cu, n), cu, n, scale),
            "gluon_qk8": lambda: gluon_fp8_prefill(quantize_fp8_inputs(q, k, v, cu, fp8_v=False), cu, n, scale)}
    for name, run in runs.items():
        if (name.startswith("gluon_fp8") and not fp8_ok) or (name == "gluon_qk8" and not qk8_ok):
            row["err_" + name] = "skipped: its variants failed their checks"
            continue
        try:
            row["err_" + name] = rel_err(run(), exact)
        except Exception as e:
            row["err_" + name] = f"{type(e).__name__}: {str(e)[:200]}"
    log(f"  outliers: {row}")
    return row


def compile_variant(name: str) -> dict:
    from slipstream.kernels.gluon_compile import compile_fp8_prefill, overlap_report, sass_overlap
    cfg, fp8_v, key_perm = kernel_config(name)
    k = compile_fp8_prefill(cfg, fp8_v=fp8_v, key_perm=key_perm)
    return {"ok": True, "shared_bytes": k.metadata.shared, **overlap_report(k.asm["ptx"]),
            "sass_exp2_under_pv": sass_overlap(k.asm["cubin"])}


def main(names: list[str], compile_only: bool) -> None:
    for name in names:
        print(json.dumps({"start": name}), flush=True)
        t0 = time.time()
        try:
            if name == "triton_fp8_path":
                res = {"ok": True, "skipped": "no GPU"} if compile_only else baseline_errors()
            else:
                res = (compile_variant if compile_only else check_variant)(name)
                if not compile_only:
                    try:
                        res["compiled"] = compile_variant(name)
                    except Exception as e:
                        res["compiled"] = f"{type(e).__name__}: {str(e)[-200:]}"
        except Exception as e:
            res = {"ok": False, "error": f"{type(e).__name__}: {str(e)[-600:]}"}
        res["seconds"] = round(time.time() - t0, 2)
        print(json.dumps({"name": name, **res}), flush=True)
        if not res["ok"] and not compile_only:
            return  # a fault may have poisoned the CUDA context: the parent restarts on the rest


if __name__ == "__main__":
    args = sys.argv[1:]
    main([a for a in args if not a.startswith("--")], "--compile-only" in args)

"""FP8 (e4m3) Gluon prefill against bf16 Gluon, cuDNN (bf16) and the Triton FP8 path,
in one run on an H100/H200:

    python3 benchmarks/attention/bench_gluon_fp8.py --out DIR [--smoke]

1. checks (child processes with a timeout, gluon_fp8_checks.py / gluon_checks.py): every
   FP8 variant against fp32 attention (ERROR_BOUND) and its PyTorch twin, every bf16
   variant against fp32; the existing paths' errors on the same cases. A variant that
   fails to compile, is wrong or hangs is reported and left out of the timing;
2. accuracy on data with outliers (0.1% of entries from N(0, 10^2), FlashAttention-3's
   test) against float64 attention: bf16 Gluon, Triton FP8 path, FP8 Gluon;
3. timing (hdim 128, 16 heads, 16k tokens): every contender's output is first checked
   against fp32 attention (its bound), then three interleaved rounds of do_bench.
   FP8 kernels are timed on inputs quantised beforehand (as they would come from an
   FP8 KV cache / a fused quantising store); `triton_fp8_e2e` includes its PyTorch rotation and
   quantisation, `gluon_fp8_e2e` the fused quantiser (fp8_quantize.py; both quantisers timed alone).
4. writes DIR/gluon_fp8.json and .md after every shape, prints a short table last.
--smoke (no GPU): compile every variant for sm_90, time tiny shapes on the CPU with the
Gluon kernels replaced by their PyTorch twins (the plumbing only).
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT), str(HERE)]

import bench_gluon_prefill as bgp  # noqa: E402
import gluon_checks  # noqa: E402
import gluon_fp8_checks as fc  # noqa: E402

HEADS, HEAD_DIM = 16, 128
SCALE = HEAD_DIM ** -0.5
BF16_BOUND = 2e-2
SHAPES = [("dense 4x4k causal", [4096] * 4, 16, True), ("dense 1x16k causal", [16384], 16, True),
          ("dense 4x4k", [4096] * 4, 16, False), ("dense 1x16k", [16384], 16, False),
          ("varlen causal", None, 16, True), ("gqa 16/4 4x4k causal", [4096] * 4, 4, True)]
SMOKE_SHAPES = [("dense 2x200 causal", [200, 200], 16, True), ("gqa ragged", [5, 140, 19], 4, False)]
BF16_RUN = ["pingpong_n128_s2", "pingpong_persistent_n128_s2", "pingpong_persistent_n128_s2_snake",
            "pingpong_persistent_n128_s3_q1_snake", "pingpong_persistent_n128_s2_snake_g2",
            "pingpong_persistent_n128_s2_lpt", "pingpong_n128_s2_table", "pingpong_persistent_n128_s2_table"]
DEV = "cuda"


def fp32_reference(q, k, v, cu, causal):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backends = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH] if DEV == "cuda" else [SDPBackend.MATH]
    with sdpa_kernel(backends):
        return gluon_checks.reference(q.float(), k.float(), v.float(), cu, causal, SCALE)


def contenders(q, k, v, cu, n_max, causal, fp8_variants, bf16_variants, fp8_default_ok):
    """name -> (call, error bound): the baselines, bf16 and FP8 Gluon variants (the FP8
    default config end to end only when its variants passed their checks: a kernel fault
    would end the process, and every shape after it)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from slipstream.kernels.fp8_attention import fp8_prefill_attention, quantize_fp8_blocks, random_orthogonal
    from slipstream.kernels.fp8_quantize import quantize_fp8_inputs_fused
    from slipstream.kernels.gluon_fp8_inputs import emulate_fp8_prefill, quantize_fp8_inputs
    from slipstream.kernels.gluon_fp8_prefill import gluon_fp8_prefill
    from slipstream.kernels.gluon_prefill import gluon_prefill
    from slipstream.kernels.prefill_attention import prefill_attention
    tokens, kv_heads = q.shape[0], k.shape[1]
    lengths = (cu[1:] - cu[:-1]).tolist()
    calls = {}
    if len(set(lengths)) == 1 and kv_heads == HEADS and DEV == "cuda":
        b = len(lengths)
        qb, kb, vb = (t.view(b, n_max, HEADS, HEAD_DIM).transpose(1, 2) for t in (q, k, v))

        def cudnn():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                o = F.scaled_dot_product_attention(qb, kb, vb, is_causal=causal, scale=SCALE)
            return o.transpose(1, 2).reshape(tokens, HEADS, HEAD_DIM)
        calls["sdpa_cudnn"] = (cudnn, BF16_BOUND)
    if DEV == "cpu":  # --smoke: twins instead of the Gluon kernels
        gluon_prefill = lambda q, k, v, cu, n, s, causal, out, config, lengths: out.copy_(  # noqa: E731
            gluon_checks.reference(q, k, v, cu, causal, s))
        gluon_fp8_prefill = lambda x, cu, n, s, causal, out, config, lengths: out.copy_(  # noqa: E731
            emulate_fp8_prefill(x, cu, s, causal=causal))
    bf16 = {"gluon_bf16": None, **{n: gluon_checks.VARIANTS[n] for n in bf16_variants}}
    for name, cfg in bf16.items():
        o = torch.empty_like(q)
        calls[name] = (lambda cfg=cfg, o=o: gluon_prefill(q, k, v, cu, n_max, SCALE, causal=causal,
                                                          out=o, config=cfg, lengths=lengths), BF16_BOUND)
    rot = random_orthogonal(HEAD_DIM, q.device)
    q8, qs = quantize_fp8_blocks(q.float() @ rot, cu, 64)
    k8, ks = quantize_fp8_blocks(k.float() @ rot, cu, 64)
    cache = torch.empty(1, 16, kv_heads, HEAD_DIM, dtype=q.dtype, device=q.device)
    ctx = torch.zeros(len(lengths), dtype=torch.int32, device=q.device)
    tables = torch.zeros(len(lengths), 1, dtype=torch.int32, device=q.device)
    t_out = torch.empty_like(q)
    calls["triton_fp8"] = (lambda: prefill_attention(q8, k8, v, cache, cache, cu, ctx, tables, n_max, SCALE,
                                                     causal=causal, q_scale=qs, k_scale=ks, out=t_out),
                           fc.ERROR_BOUND)
    calls["triton_fp8_e2e"] = (lambda: fp8_prefill_attention(q, k, v, cu, n_max, SCALE, causal=causal,
                                                             out=t_out), fc.ERROR_BOUND)
    v16 = v if v.dtype == torch.bfloat16 else v.half()  # --smoke runs fp32
    xs = {(True, False): quantize_fp8_inputs(q, k, v, cu, key_perm=False),
          (True, True): quantize_fp8_inputs(q, k, v, cu, key_perm=True),
          (False, False): quantize_fp8_inputs(q, k, v16, cu, fp8_v=False)}
    for name in fp8_variants:
        o = torch.empty_like(q)
        cfg, fp8_v, key_perm = fc.kernel_config(name)
        calls[name] = (lambda cfg=cfg, x=xs[fp8_v, key_perm], o=o: gluon_fp8_prefill(
            x, cu, n_max, SCALE, causal=causal, out=o, config=cfg, lengths=lengths), fc.ERROR_BOUND)
    o8 = torch.empty_like(q)
    fused = quantize_fp8_inputs_fused if DEV == "cuda" else (
        lambda q, k, v, cu, n: quantize_fp8_inputs(q, k, v, cu))
    if fp8_default_ok:
        calls["gluon_fp8_e2e"] = (lambda: gluon_fp8_prefill(fused(q, k, v, cu, n_max), cu, n_max, SCALE,
                                                            causal=causal, out=o8, config=None,
                                                            lengths=lengths), fc.ERROR_BOUND)
    return calls, {"quantize_torch": lambda: quantize_fp8_inputs(q, k, v, cu),
                   "quantize_fused": lambda: fused(q, k, v, cu, n_max)}


def time_shape(name, lengths, kv_heads, causal, fp8_variants, bf16_variants, fp8_default_ok, log) -> dict:
    import torch
    from prefill_cases import attn_flops
    from timing import cu_seqlens, interleaved
    lengths = bgp._lengths(lengths)
    tokens, n_max = sum(lengths), max(lengths)
    dtype = torch.bfloat16 if DEV == "cuda" else torch.float32
    gen = torch.Generator(device=DEV).manual_seed(0)
    q = torch.randn(tokens, HEADS, HEAD_DIM, device=DEV, dtype=dtype, generator=gen)
    k, v = (torch.randn(tokens, kv_heads, HEAD_DIM, device=DEV, dtype=dtype, generator=gen) for _ in range(2))
    cu = cu_seqlens(lengths, DEV)
    flops = attn_flops(lengths, lengths, causal)
    row = {"shape": name, "lengths": lengths if len(lengths) <= 8 else f"{len(lengths)} ragged",
           "kv_heads": kv_heads, "causal": causal, "flops": flops, "tflops": {}, "err": {}}
    ref = fp32_reference(q, k, v, cu, causal)
    calls, quantizers = contenders(q, k, v, cu, n_max, causal, fp8_variants, bf16_variants, fp8_default_ok)
    timers = {}
    for cname, (call, bound) in calls.items():  # once each: compile, check against fp32, then time
        try:
            out = call()
            if DEV == "cuda":
                torch.cuda.synchronize()
            row["err"][cname] = err = gluon_checks.rel_err(out, ref)
        except Exception as e:
            row["err"][cname] = f"{type(e).__name__}: {str(e)[:200]}"
            continue
        if err <= bound:
            timers[cname] = lambda call=call: bgp._bench_ms(call)
        else:
            row["err"][cname] = f"{err:.3g} over its bound {bound}: not timed"
    if timers:
        timers.update({n: lambda f=f: bgp._bench_ms(f) for n, f in quantizers.items()})
    for cname, t in interleaved(timers, rounds=3).items():
        if cname in quantizers:
            row[cname + "_ms"] = t["ms"]
        else:
            row["tflops"][cname] = flops / t["ms"] / 1e9
    log(f"  {name}: " + ", ".join(f"{c} {t:.0f}" for c, t in row["tflops"].items()))
    return row


def short_table(res: dict) -> str:
    """Per shape: cuDNN, bf16 Gluon (its default, and the best bf16 variant), the Triton FP8
    path, the best FP8 variant; FP8 against the better of the two bf16 Gluon figures."""
    failed = [n for n, r in res["checks"].items() if not r["ok"]]
    lines = [f"variants failing their checks: {failed or 'none'} (details in gluon_fp8.md)",
             "| shape | cuDNN | bf16 gluon | best bf16 variant | x cuDNN | triton fp8 | best fp8 variant "
             "| fp8 e2e | fp8 x bf16 | fp8 x cuDNN | fp8 x triton fp8 | err fp8 / triton fp8 "
             "| QK-only fp8 (x bf16, err) |", "|" + "---|" * 13]
    for row in res["shapes"]:
        t, e = row["tflops"], row["err"]

        def best(names):
            have = {c: x for c, x in t.items() if c in names}
            return max(have, key=have.get) if have else None
        b8, b16 = best([n for n in fc.VARIANTS if n.startswith("fp8")]), best(gluon_checks.VARIANTS)
        bq = best([n for n in fc.VARIANTS if n.startswith("qk8")])
        bf16 = max([t[c] for c in ("gluon_bf16", b16) if c in t], default=None)
        f = lambda c: f"{t[c]:.0f}" if c in t else "-"  # noqa: E731
        r = lambda a, b: f"{a / b:.2f}x" if a and b else "-"  # noqa: E731
        fp8 = t.get(b8)
        errs = " / ".join(f"{e[c]:.1e}" if isinstance(e.get(c), float) else "-" for c in (b8, "triton_fp8"))
        qk8 = f"{bq} {f(bq)} ({r(t.get(bq), bf16)}, {e[bq]:.1e})" if bq else "-"
        lines.append(f"| {row['shape']} | {f('sdpa_cudnn')} | {f('gluon_bf16')} | {b16} {f(b16)} | "
                     f"{r(bf16, t.get('sdpa_cudnn'))} | {f('triton_fp8')} | {b8} {f(b8)} | "
                     f"{f('gluon_fp8_e2e')} | {r(fp8, bf16)} | {r(fp8, t.get('sdpa_cudnn'))} | "
                     f"{r(fp8, t.get('triton_fp8'))} | {errs} | {qk8} |")
    if res.get("outliers"):
        lines.append("outlier data, error vs float64: " + ", ".join(
            f"{k[4:]} {v:.2e}" if isinstance(v, float) else f"{k[4:]} {v}"
            for k, v in res["outliers"].items() if k.startswith("err_")))
    return "\n".join(lines)


def save(res: dict, out: Path, t0: float) -> None:
    res["seconds"] = time.time() - t0
    (out / "gluon_fp8.json").write_text(json.dumps(res, indent=1))
    md = [f"# FP8 Gluon prefill (hdim 128, 16 heads, TFLOP/s)\n\n{res['device']}, torch {res['torch']}, "
          f"triton {res['triton']}, {res['seconds']:.0f} s\n", "## Checks\n", "```",
          json.dumps(res["checks"], indent=1), "```\n", "## Shapes\n", "```",
          json.dumps(res["shapes"], indent=1), "```\n", "## Summary\n", short_table(res)]
    (out / "gluon_fp8.md").write_text("\n".join(md) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=HERE / "results" / "gluon_fp8")
    ap.add_argument("--smoke", action="store_true", help="no GPU: compile for sm_90, CPU plumbing run")
    ap.add_argument("--fp8-variants", nargs="*", default=fc.DEFAULT_RUN, choices=list(fc.VARIANTS))
    ap.add_argument("--bf16-variants", nargs="*", default=BF16_RUN, choices=list(gluon_checks.VARIANTS))
    ap.add_argument("--limit", type=float, default=220, help="watchdog seconds (default 220)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    global DEV
    if args.smoke:
        DEV = bgp.DEVICE = "cpu"
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    import triton

    def log(msg):
        print(f"[{time.time() - t0:6.1f}s] {msg}", flush=True)

    res = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (smoke)",
           "torch": torch.__version__, "triton": triton.__version__, "checks": {}, "shapes": []}

    def fire():
        faulthandler.dump_traceback()
        for child in list(bgp.CHILDREN):
            child.kill()
        res["aborted"] = f"stopped after {args.limit} s"
        save(res, args.out, t0)
        print(short_table(res), flush=True)
        os._exit(3)
    threading.Timer(args.limit, fire).start()
    log("checks" + (" (compile only)" if args.smoke else ""))
    bgp.VARIANT_TIMEOUT_S = 100  # two sets of children compile at once: slower than alone
    with ThreadPoolExecutor(2) as pool:  # the FP8 and the bf16 checks side by side
        fp8 = pool.submit(bgp.run_checks, ["triton_fp8_path"] + args.fp8_variants, args.smoke, log,
                          script="gluon_fp8_checks.py")
        bf16 = pool.submit(bgp.run_checks, args.bf16_variants, args.smoke, log) if args.bf16_variants else None
        res["checks"] = {**fp8.result(), **(bf16.result() if bf16 else {})}
    passing = [n for n, r in res["checks"].items() if r["ok"]]
    fp8_ok = {"fp8_s2_noturns", "fp8_persistent_s2_snake_noturns"} <= set(passing)  # the default's
    qk8_ok = "qk8_s2" in passing
    try:
        res["outliers"] = fc.outlier_accuracy(DEV, log, fp8_ok, qk8_ok)
    except Exception as e:
        res["outliers"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    for name, lengths, kv_heads, causal in SMOKE_SHAPES if args.smoke else SHAPES:
        try:
            res["shapes"].append(time_shape(name, lengths, kv_heads, causal,
                                            [n for n in args.fp8_variants if n in passing],
                                            [n for n in args.bf16_variants if n in passing], fp8_ok, log))
        except Exception as e:  # one shape's failure must not lose the others
            res["shapes"].append({"shape": name, "tflops": {}, "err": {"all": f"{type(e).__name__}: {e}"[:300]}})
        save(res, args.out, t0)
    print(short_table(res), flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()

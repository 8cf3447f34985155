"""The Gluon (FlashAttention-3-style) prefill kernel on an H100/H200, in one run.

    python3 benchmarks/attention/bench_gluon_prefill.py --out DIR [--smoke]

1. each variant (gluon_checks.DEFAULT_RUN, or --variants) is checked against an
   fp32 reference in child processes with a timeout; one that fails to compile,
   is wrong or hangs is reported and left out of the timing;
2. the prefill shapes (hdim 128, 16 heads, 16k tokens: 4 x 4k and 1 x 16k, causal
   and not; ragged; GQA 16/4) are timed for SDPA flash and cuDNN, our Triton kernel
   and every passing variant, interleaved, each output first checked;
3. writes DIR/gluon_prefill.json and .md and prints a short table (best variant a shape).
--smoke (no GPU): compile every variant for sm_90, and run step 2 on tiny shapes on the
CPU with the Gluon calls replaced by the reference (the script's plumbing only).
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import selectors
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT), str(HERE)]

from gluon_checks import DEFAULT_RUN, VARIANTS, rel_err  # noqa: E402

HEADS, HEAD_DIM, TOKENS = 16, 128, 16384
SCALE = HEAD_DIM ** -0.5
VARIANT_TIMEOUT_S = 45  # a variant's checks (4 compiles) take seconds; longer means a hang
# The Triton kernel as autotuned on the H200 (results/h200_2026-11-29d.json; + PAIRED for causal <= 4k)
TRITON_CONFIG = {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3}
SMOKE_SHAPES = [("dense 2x64 causal", [64, 64], 16, True), ("gqa ragged", [5, 40, 19], 4, False)]
DEVICE, DTYPE = "cuda", "bfloat16"  # --smoke: "cpu", "float16" (the interpreter's bf16 dots are wrong)
TOTAL_LIMIT_S = 85  # past this, write what was measured and exit (a hang, or a slow run)
CHILDREN: set = set()
# name, request lengths, kv heads, causal
SHAPES = [("dense 4x4k causal", [4096] * 4, 16, True),
          ("dense 1x16k causal", [16384], 16, True),
          ("dense 4x4k", [4096] * 4, 16, False),
          ("dense 1x16k", [16384], 16, False),
          ("varlen causal", None, 16, True),
          ("gqa 16/4 4x4k causal", [4096] * 4, 4, True)]


def run_checks(names: list[str], smoke: bool, log, parallel: int = 6,
               script: str = "gluon_checks.py") -> dict:
    """Variant -> check result, from `parallel` children of `script` (a hung one restarted)."""
    groups = [names[i::parallel] for i in range(parallel)]
    results = {}
    with ThreadPoolExecutor(parallel) as pool:
        for part in pool.map(lambda g: _check_group(g, smoke, log, script), [g for g in groups if g]):
            results.update(part)
    return {n: results[n] for n in names}


def _check_group(names: list[str], smoke: bool, log, script: str) -> dict:
    results, todo = {}, list(names)
    while todo:
        cmd = [sys.executable, str(HERE / script), *todo] + (["--compile-only"] if smoke else [])
        child = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT,
                                 env=dict(os.environ, TRITON_INTERPRET="0"))
        CHILDREN.add(child)  # killed by the watchdog if it fires
        current, deadline, sel = None, time.time() + VARIANT_TIMEOUT_S, selectors.DefaultSelector()
        sel.register(child.stdout, selectors.EVENT_READ)
        while True:
            if not sel.select(timeout=max(deadline - time.time(), 0.1)):
                if time.time() < deadline:
                    continue
                child.kill()
                results[current or todo[0]] = {"ok": False, "error": f"no result in {VARIANT_TIMEOUT_S} s (hang?)"}
                log(f"  {current}: timed out, killed")
                break
            line = child.stdout.readline()
            if not line:
                break
            msg = json.loads(line)
            if "start" in msg:
                current, deadline = msg["start"], time.time() + VARIANT_TIMEOUT_S
                continue
            results[msg.pop("name")] = msg
            log(f"  {current}: {json.dumps(msg)[:300]}")
            current = None
        if child.wait() != 0 and current is not None and current not in results:
            results[current] = {"ok": False, "error": f"check process died (exit {child.returncode})"}
        left = [n for n in todo if n not in results]
        if left == todo:  # died before starting any: give up on these
            results.update({n: {"ok": False, "error": "check process exited without a result"} for n in left})
        todo = left if left != todo else []
    return results


def _lengths(lengths):
    if lengths is not None:
        return lengths
    import torch
    gen, out, total = torch.Generator().manual_seed(1), [], 0
    while total < TOKENS:  # the attention benchmark's ragged batch
        n = min(int(torch.randint(200, 4000, (1,), generator=gen)), TOKENS - total)
        out.append(n)
        total += n
    return out


def time_shape(name, lengths, kv_heads, causal, variants, tune_triton, log) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from prefill_cases import attn_flops
    from timing import cu_seqlens, interleaved
    from slipstream.kernels.gluon_prefill import gluon_prefill
    from slipstream.kernels.prefill_attention import prefill_attention

    lengths = _lengths(lengths)
    dev, tokens, n_max = DEVICE, sum(lengths), max(lengths)
    dtype = getattr(torch, DTYPE)
    q = torch.randn(tokens, HEADS, HEAD_DIM, device=dev, dtype=dtype)
    k, v = (torch.randn(tokens, kv_heads, HEAD_DIM, device=dev, dtype=dtype) for _ in range(2))
    cu = cu_seqlens(lengths, dev)
    flops = attn_flops(lengths, lengths, causal)
    row = {"shape": name, "lengths": lengths if len(lengths) <= 8 else f"{len(lengths)} ragged",
           "kv_heads": kv_heads, "causal": causal, "flops": flops, "tflops": {}, "err": {}}
    calls = {}
    if len(set(lengths)) == 1 and kv_heads == HEADS:  # SDPA on the dense [B, H, N, D] view
        b = len(lengths)
        qb, kb, vb = (x.view(b, n_max, HEADS, HEAD_DIM).transpose(1, 2) for x in (q, k, v))
        for sdpa, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
            def call(backend=backend):
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(qb, kb, vb, is_causal=causal, scale=SCALE)
            calls[sdpa] = (call, lambda o: o.transpose(1, 2).reshape(tokens, HEADS, HEAD_DIM))
    cache = torch.empty(1, 16, kv_heads, HEAD_DIM, dtype=q.dtype, device=dev)
    ctx = torch.zeros(len(lengths), dtype=torch.int32, device=dev)
    tables = torch.zeros(len(lengths), 1, dtype=torch.int32, device=dev)
    t_out = torch.empty_like(q)
    t_cfg = None if tune_triton else {**TRITON_CONFIG, "PAIRED": causal and n_max <= 4096}
    calls["triton"] = (lambda: prefill_attention(q, k, v, cache, cache, cu, ctx, tables, n_max, SCALE,
                                                 causal=causal, out=t_out, config=t_cfg), lambda o: o)
    if DEVICE == "cpu":  # --smoke: the script's plumbing only, Gluon replaced by the reference
        from gluon_checks import reference

        def gluon_prefill(q, k, v, cu, n, scale, causal, out, config, lengths):
            return out.copy_(reference(q, k, v, cu, causal, scale))
    for vname in variants:
        g_out = torch.empty_like(q)
        calls[vname] = (lambda cfg=VARIANTS[vname], g_out=g_out: gluon_prefill(
            q, k, v, cu, n_max, SCALE, causal=causal, out=g_out, config=cfg, lengths=lengths), lambda o: o)
    ref, timers = None, {}
    for cname, (call, view) in calls.items():  # run once each: compile, check, then time
        try:
            out = view(call())
            if DEVICE == "cuda":
                torch.cuda.synchronize()
        except Exception as e:
            row["err"][cname] = f"{type(e).__name__}: {str(e)[:200]}"
            continue
        if ref is None:
            ref, row["reference"] = out.clone(), cname
        row["err"][cname] = rel_err(out, ref)
        if row["err"][cname] < 2e-2:
            timers[cname] = lambda call=call: _bench_ms(call)
    for cname, t in interleaved(timers, rounds=3).items():
        row["tflops"][cname] = flops / t["ms"] / 1e9
    log(f"  {name}: " + ", ".join(f"{c} {t:.0f}" for c, t in row["tflops"].items()))
    return row


def _bench_ms(fn) -> float:
    if DEVICE == "cuda":
        return __import__("triton").testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def markdown(res: dict) -> str:
    lines = ["# Gluon prefill (bf16, hdim 128, 16 heads, TFLOP/s)", "",
             f"{res['device']}, torch {res['torch']}, triton {res['triton']}, {res['seconds']:.0f} s", "",
             "## Variant checks", "", "(sass_exp2_under_pv: exp2 per thread between the two wgmma waits "
             "in the SASS, i.e. softmax under P.V; 0 = no overlap)", "",
             "| variant | ok | error / compiled |", "|---|---|---|"]
    for name, r in res["checks"].items():
        comp = r.get("compiled", r)
        comp = {k: comp[k] for k in ("wgmma", "sass_exp2_under_pv", "shared_bytes")
                if isinstance(comp, dict) and k in comp}
        errs = [(n.endswith("max_abs"), e) for n, e in r.get("errors", {}).items()]
        detail = r.get("error") or (f"rel err <= {max(e for a, e in errs if not a):.1e}, max abs "
                                    f"{max(e for a, e in errs if a):.1e};" if errs else "")
        lines.append(f"| {name} | {r['ok']} | {detail} {comp} |")
    for row in res["shapes"]:
        t = row["tflops"]
        gluon = {c: x for c, x in t.items() if c in VARIANTS}
        best = max(gluon, key=gluon.get) if gluon else None
        lines += ["", f"## {row['shape']} (lengths {row['lengths']}, kv heads {row['kv_heads']})", "",
                  "| kernel | TFLOP/s | x cuDNN | x flash | x triton | rel err |", "|---|---|---|---|---|---|"]
        for c, x in sorted(t.items(), key=lambda kv: -kv[1]):
            ratios = [f"{x / t[b]:.2f}x" if b in t else "-" for b in ("sdpa_cudnn", "sdpa_flash", "triton")]
            err = row["err"].get(c)
            lines.append(f"| {c}{' (best gluon)' if c == best else ''} | {x:.0f} | {' | '.join(ratios)} | "
                         f"{err:.1e} |" if isinstance(err, float) else f"| {c} | {x:.0f} | | | | |")
        for c, e in row["err"].items():
            if c not in t:
                lines.append(f"| {c}: not timed | | | | | {e} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=HERE / "results" / "gluon")
    ap.add_argument("--smoke", action="store_true",
                    help="no GPU: compile every variant for sm_90; time tiny shapes on the CPU with "
                         "the Gluon calls replaced by the reference (the script's plumbing only)")
    ap.add_argument("--variants", nargs="*", default=DEFAULT_RUN, choices=list(VARIANTS),
                    help="Gluon variants to check and time (default: DEFAULT_RUN)")
    ap.add_argument("--limit", type=float, help=f"watchdog seconds (default {TOTAL_LIMIT_S}; 600 --smoke)")
    ap.add_argument("--tune-triton", action="store_true",
                    help="autotune the Triton kernel here (slower) instead of its tuned H200 configs")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    if args.smoke:  # the Triton kernel in its interpreter (set before triton is imported)
        global DEVICE, DTYPE
        DEVICE, DTYPE = "cpu", "float16"
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    import triton

    def log(msg):
        print(f"[{time.time() - t0:6.1f}s] {msg}", flush=True)

    res = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (compile only)",
           "torch": torch.__version__, "triton": triton.__version__, "checks": {}, "shapes": []}
    watchdog(res, args.out, t0, args.limit or (600 if args.smoke else TOTAL_LIMIT_S))
    log("variant checks" + (" (compile only)" if args.smoke else ""))
    res["checks"] = run_checks(args.variants, args.smoke, log)
    passing = [n for n, r in res["checks"].items() if r["ok"]]
    for name, lengths, kv_heads, causal in SMOKE_SHAPES if args.smoke else SHAPES:
        try:
            res["shapes"].append(time_shape(name, lengths, kv_heads, causal, passing,
                                            args.tune_triton, log))
        except Exception as e:  # one shape's failure must not lose the others
            res["shapes"].append({"shape": name, "lengths": lengths, "kv_heads": kv_heads,
                                  "tflops": {}, "err": {"all": f"{type(e).__name__}: {e}"[:300]}})
        save(res, args.out, t0)
    save(res, args.out, t0)
    print(short_table(res))


def short_table(res: dict) -> str:
    """Per shape: the best passing Gluon variant against the baselines (TFLOP/s)."""
    failed = [n for n, r in res["checks"].items() if not r["ok"]]
    lines = [f"variants failing their checks: {failed or 'none'} (details in gluon_prefill.md)",
             "| shape | best gluon | TFLOP/s | cuDNN | flash | triton | x cuDNN | x triton | pinned/unpinned |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in res["shapes"]:
        t = row["tflops"]
        gluon = {c: x for c, x in t.items() if c in VARIANTS}
        best = max(gluon, key=gluon.get) if gluon else None
        cells = [f"{t[c]:.0f}" if c in t else "-" for c in (best, "sdpa_cudnn", "sdpa_flash", "triton")]
        ratios = [f"{t[best] / t[c]:.2f}x" if best and c in t else "-" for c in ("sdpa_cudnn", "triton")]
        pin = [f"{t[a] / t[a + '_unpinned']:.2f}x" for a in ("pingpong_n128_s3", "pingpong_n128_s2")
               if a in t and a + "_unpinned" in t]  # what keeping the P.V wait in place buys
        lines.append(f"| {row['shape']} | {best} | {' | '.join(cells)} | {' | '.join(ratios)} | "
                     f"{', '.join(pin) or '-'} |")
    return "\n".join(lines)


def save(res: dict, out: Path, t0: float) -> str:
    res["seconds"] = time.time() - t0
    (out / "gluon_prefill.json").write_text(json.dumps(res, indent=1))
    md = markdown(res) + "\n## Summary\n\n" + short_table(res) + "\n"
    (out / "gluon_prefill.md").write_text(md)
    return md


def watchdog(res: dict, out: Path, t0: float, limit: float) -> None:
    """Past `limit` seconds: print where the run is, save what was measured, exit."""
    def fire():
        faulthandler.dump_traceback()
        for child in list(CHILDREN):
            child.kill()
        res["aborted"] = f"stopped after {limit} s"
        save(res, out, t0)
        print(short_table(res), flush=True)
        os._exit(3)
    timer = threading.Timer(limit, fire)
    timer.daemon = True
    timer.start()


if __name__ == "__main__":
    main()

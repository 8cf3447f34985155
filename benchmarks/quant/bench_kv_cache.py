"""Quantized KV cache on the GPU: correctness, then decode attention and a model
decode step with int8 / fp8 KV against the bf16 KV cache (H200, about 2 minutes).

1. Correctness (bf16 activations, Llama-3-8B heads: GQA 32/8, head_dim 128): the
   KV-store kernel against `reference.store_kv` (same scales, codes equal up to
   rounding ties), and the decode, tree and paged-prefill kernels reading int8 /
   fp8 codes against their twins in kernels/reference.py (dequantized in fp32);
   plus the error the quantization itself adds (against attention over the exact
   bf16 K/V). Timing runs only if every check passes.
2. Decode attention (split-KV FlashDecoding kernel), batch 1 at 32k context and
   batch 32 at 4k, paged cache (16-token pages, randomly permuted), timed in CUDA
   graphs over enough data copies that every call streams from HBM: microseconds,
   bytes moved (codes + scales), share of the copy bandwidth measured in the same
   run, and the speedup over the bf16 cache. The engine's launch config is timed
   first; then a sweep of tile configs and split counts for the 1-byte caches
   (the engine's defaults for them were chosen from the compiled code, not timed).
3. Model decode step (skip with --skip-model): Llama-3-8B shape, random bf16
   weights, one token per sequence (batch 1 at 32k context, batch 32 at 4k), the
   whole forward captured in a CUDA graph, per KV cache dtype: tokens/s.

    python benchmarks/quant/bench_kv_cache.py [--out DIR]            # H200
    python benchmarks/quant/bench_kv_cache.py --smoke --out /tmp/kv  # CPU, interpreter, tiny shapes
    python benchmarks/quant/bench_kv_cache.py --quick [--smoke] [--out DIR]
        # batch-1 decode only, every quantized-path variant and a launch-config sweep
        # (kv_decode_sweep.py; about a minute on an H200): kv_decode_quick.{json,md}
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:   # before triton is imported anywhere
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from slipstream.kernels.decode_attention import (  # noqa: E402
    choose_num_splits, decode_attention, split_kv_scratch)
from kv_cache_checks import make_timer  # noqa: E402
from kv_cache_checks import (  # noqa: E402
    HEAD_DIM, HEADS, KV_HEADS, SCALE, correctness, paged, quantize_cache, rel_err)
from kv_cache_model import KINDS, model_step  # noqa: E402

L2_BYTES = 256 << 20
# (BLOCK_N, num_warps, num_stages) tried for the 1-byte caches; split factors
# around the automatic count.
SWEEP = [(64, 2, 4), (64, 2, 6), (64, 4, 6), (128, 4, 4), (128, 4, 6), (128, 4, 8)]
SPLIT_FACTORS = (0.5, 1.0, 2.0)




# --- 2. decode attention -------------------------------------------------------------

def decode_case(b, length, copy_bw, device, dtype, smoke, log) -> dict:
    gen = torch.Generator().manual_seed(b * 7 + length)
    bf16_bytes = 2 * b * length * KV_HEADS * HEAD_DIM * 2
    n = 1 if smoke else max(1, min(8, math.ceil(L2_BYTES / bf16_bytes)))
    data = []
    for _ in range(n):
        k = torch.randn(b, length, KV_HEADS, HEAD_DIM, device=device, dtype=dtype)
        v = torch.randn_like(k)
        kc, vc, tables = paged(k, v, gen)
        del k, v
        q = torch.randn(b, HEADS, HEAD_DIM, device=device, dtype=dtype)
        caches = {}
        for kind in KINDS:
            kq, ks = quantize_cache(kc, kind)
            vq, vs = quantize_cache(vc, kind)
            caches[kind] = (kq, vq, ks, vs)
        data.append((q, tables, caches))
    seq_lens = torch.full((b,), length, dtype=torch.int32, device=device)
    cu = torch.arange(b + 1, dtype=torch.int32, device=device)
    auto = choose_num_splits(b, KV_HEADS, length, group=HEADS // KV_HEADS)

    def calls(kind, splits, config=None):
        out = []
        for q, tables, caches in data:
            kq, vq, ks, vs = caches[kind]
            o = torch.empty_like(q)
            s = split_kv_scratch(b, HEADS, splits, HEAD_DIM, device) if splits > 1 else None
            out.append(lambda q=q, t=tables, kq=kq, vq=vq, ks=ks, vs=vs, o=o, s=s: decode_attention(
                q, kq, vq, seq_lens, t, SCALE, max_seq_len=length, num_splits=splits,
                cu_seqlens_q=cu, out=o, scratch=s, config=config, k_scale=ks, v_scale=vs))
        return out

    def nbytes(kind):
        if kind == "bf16":
            return bf16_bytes
        return 2 * b * length * KV_HEADS * (HEAD_DIM + 4)   # codes + fp32 scales

    row = {"B": b, "L": length, "copies": n, "splits_auto": auto}
    # Agreement of the three on the first copy (quantized vs bf16 cache).
    outs = {kind: calls(kind, auto)[0]() for kind in KINDS}
    for kind in ("int8", "fp8"):
        row[f"{kind}_rel_err_vs_bf16_kv"] = rel_err(outs[kind], outs["bf16"])
    timers = {kind: make_timer(calls(kind, auto), smoke) for kind in KINDS}
    times = {kind: [] for kind in KINDS}
    for _ in range(1 if smoke else 5):   # interleaved rounds: drift hits all alike
        for kind, t in timers.items():
            times[kind].append(t())
    med = {kind: sorted(ts)[len(ts) // 2] for kind, ts in times.items()}
    for kind in KINDS:
        ms = med[kind]
        row[kind] = {"us": ms * 1e3, "bytes": nbytes(kind),
                     "pct_copy_bw": 100 * nbytes(kind) / (ms * 1e-3) / copy_bw,
                     "speedup_vs_bf16": med["bf16"] / ms}
    log(f"  decode B={b} L={length}: " + ", ".join(
        f"{k} {row[k]['us']:.1f} us ({row[k]['pct_copy_bw']:.0f}% copy bw, "
        f"x{row[k]['speedup_vs_bf16']:.2f})" for k in KINDS))
    # Sweep: launch configs and split counts for the 1-byte caches.
    bf16_ms = med["bf16"]
    for kind in ("int8", "fp8"):
        sweep = {}
        factors = SPLIT_FACTORS[1:2] if smoke else SPLIT_FACTORS
        for splits in sorted({max(1, min(64, round(auto * f))) for f in factors}):
            for bn, w, st in (SWEEP[:1] + SWEEP[4:5]) if smoke else SWEEP:
                name = f"S{splits}_N{bn}_w{w}_s{st}"
                cfg = {"BLOCK_N": bn, "num_warps": w, "num_stages": st}
                try:
                    ms = make_timer(calls(kind, splits, cfg), smoke)()
                    sweep[name] = {"us": ms * 1e3, "pct_copy_bw": 100 * nbytes(kind) / (ms * 1e-3) / copy_bw,
                                   "speedup_vs_bf16": bf16_ms / ms}
                except Exception as e:   # e.g. out of shared memory
                    sweep[name] = {"error": f"{type(e).__name__}: {str(e)[:120]}"}
        best = max((r["speedup_vs_bf16"], n) for n, r in sweep.items() if "us" in r)
        row[f"{kind}_sweep"] = sweep
        row[f"{kind}_best"] = {"config": best[1], **sweep[best[1]]}
        log(f"    {kind} best: {best[1]} x{best[0]:.2f} ({sweep[best[1]]['pct_copy_bw']:.0f}% copy bw)")
    return row


def markdown(res) -> str:
    lines = ["# Quantized KV cache: decode attention and model decode step", "",
             f"{res['meta']['device']}; copy bandwidth {res['meta'].get('copy_GBps', 0):.0f} GB/s"
             f"{' (smoke run: CPU interpreter, tiny shapes, times meaningless)' if res['meta']['smoke'] else ''}. "
             "Llama-3-8B heads (GQA 32/8, head_dim 128), 16-token pages. int8 and fp8 (e4m3) "
             "hold 1-byte codes plus one fp32 scale per token and head.", "",
             f"Correctness: {'all checks pass' if res['correctness']['ok'] else 'FAILED'} "
             "(see JSON).", "",
             "## Decode attention (engine launch config)", "",
             "| B | context | KV | us | % copy bw | speedup vs bf16 | best swept config | best speedup |",
             "| ---: | ---: | --- | ---: | ---: | ---: | --- | ---: |"]
    for r in res.get("decode", []):
        for kind in KINDS:
            if kind not in r:
                continue
            best = r.get(f"{kind}_best")
            tail = f"{best['config']} | {best['speedup_vs_bf16']:.2f}x |" if best else " | |"
            lines.append(f"| {r['B']} | {r['L']} | {kind} | {r[kind]['us']:.1f} | "
                         f"{r[kind]['pct_copy_bw']:.0f}% | {r[kind]['speedup_vs_bf16']:.2f}x | " + tail)
    if res.get("model"):
        lines += ["", "## Model decode step (Llama-3-8B shape, random weights, CUDA graph)", "",
                  "| B | context | KV | ms/step | tokens/s | speedup vs bf16 KV |",
                  "| ---: | ---: | --- | ---: | ---: | ---: |"]
        for r in res["model"]:
            for kind in KINDS:
                if "ms" in r.get(kind, {}):
                    lines.append(f"| {r['B']} | {r['context']} | {kind} | {r[kind]['ms']:.3f} | "
                                 f"{r[kind]['tokens_per_s']:.1f} | {r[kind]['speedup_vs_bf16_kv']:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    ap.add_argument("--skip-model", action="store_true", help="kernels only")
    ap.add_argument("--quick", action="store_true",
                    help="batch-1 decode variants and launch configs only (kv_decode_sweep.py)")
    ap.add_argument("--budget-s", type=float, default=80.0,
                    help="--quick: seconds after which the remaining timings are skipped")
    args = ap.parse_args(argv)
    smoke = args.smoke
    device = "cpu" if smoke else "cuda"
    dtype = torch.float16 if smoke else torch.bfloat16   # the interpreter cannot run bf16 dots
    t0 = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def log(msg):
        print(f"[{time.time() - t0:6.1f}s] {msg}", flush=True)

    res = {"meta": {"device": "cpu (smoke)" if smoke else torch.cuda.get_device_name(),
                    "torch": torch.__version__, "machine": platform.node(), "smoke": smoke}}

    def save():
        (out / "kv_cache_bench.json").write_text(json.dumps(res, indent=1))
        (out / "kv_cache_bench.md").write_text(markdown(res))

    if args.quick:
        from kv_decode_sweep import quick

        def save_quick(res, md):
            (out / "kv_decode_quick.json").write_text(json.dumps(res, indent=1))
            (out / "kv_decode_quick.md").write_text(md)
            return md
        rc = quick(out, device, dtype, smoke, log, save_quick, args.budget_s)
        print((out / "kv_decode_quick.md").read_text())
        return rc
    res["correctness"] = correctness(device, dtype, log, smoke)
    save()
    if not res["correctness"]["ok"]:
        log("correctness FAILED: no timing")
        return 1
    copy_bw = 1e9   # (smoke: a nominal 1 GB/s)
    if not smoke:
        from slipstream.analysis.hardware import measure_copy_bandwidth
        copy_bw = measure_copy_bandwidth("cuda")
        res["meta"]["copy_GBps"] = copy_bw / 1e9
        log(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s")
    cases = [(1, 96), (2, 48)] if smoke else [(1, 32768), (32, 4096)]
    res["decode"] = []
    for b, length in cases:
        res["decode"].append(decode_case(b, length, copy_bw, device, dtype, smoke, log))
        save()
        if device == "cuda":
            torch.cuda.empty_cache()
    if not args.skip_model:
        res["model"] = model_step([(1, 64), (2, 40)] if smoke else cases, device, dtype, smoke, log)
        save()
    log("done")
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())

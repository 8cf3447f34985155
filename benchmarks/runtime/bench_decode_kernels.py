"""Decode-step kernels on the GPU in one run: correctness first, then old against new.

    python benchmarks/runtime/bench_decode_kernels.py [--out DIR] [--commit SHA]
    python benchmarks/runtime/bench_decode_kernels.py --smoke   # CPU, TRITON_INTERPRET=1, tiny shapes

Llama-3-8B attention shape: 32 query / 8 KV heads, head_dim 128, pages of 16.
1. Correctness on the device (bf16 queries): the short-context decode kernel in
   every launch config and the engine's dispatch, bf16 / int8 / fp8 caches,
   contexts 1..4k, against reference.decode_attention; rotary + KV store against
   the unfused kernels (exact) and its torch twin; a CUDA-graph replay of the new
   attention block equals its eager run.
2. The copy bandwidth, measured in this run.
3. Decode attention alone, batch 1 / 8 / 64 x context 128 / 1k / 4k x cache bf16 /
   int8 / fp8: the split-KV kernel with the split count a captured decode graph
   uses (old; unsplit up to 512) against the short-context kernel in each config,
   and the split-KV kernel split finer (splits of >= 64 keys).
4. A layer's attention block in a decode step: rotary, KV store, attention (old)
   against rotary + KV store in one kernel and the engine's attention choice (new).
Times: median us per call; each side captured in one CUDA graph over enough
copies of queries and caches (distinct pages of one pool, > 100 MB) that a replay
streams K/V from HBM, as in a decode step where the weights evict the cache from
L2. Writes DIR/decode_kernels.json and DIR/decode_kernels.md.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT), str(HERE)]

from decode_gemv_cases import GEMV_CONFIGS, gemv  # noqa: E402
from decode_kernel_cases import (  # noqa: E402
    CACHES, HEAD_DIM, KV_HEADS, RUN, SHORT_CONFIGS, attention_calls, block_calls, correctness,
    graph_replay_equal, max_err, rope_tables, setup_case, time_calls)

BATCHES, CONTEXTS = (1, 8, 64), (128, 1024, 4096)
STREAM_BYTES, MAX_COPIES = 128 << 20, 512


def timing(torch, device, batches, contexts, caches, copy_bw) -> tuple[list, list]:
    rope = rope_tables(torch, device)
    attn, blocks = [], []
    for kind in caches:
        for b in batches:
            for ctx in contexts:
                kv_bytes = 2 * b * ctx * KV_HEADS * HEAD_DIM * (2 if kind == "bf16" else 1)
                copies = 1 if RUN.smoke else max(1, min(MAX_COPIES, math.ceil(STREAM_BYTES / kv_bytes)))
                s = setup_case(torch, b, ctx, kind, device, copies)
                row = {"batch": b, "context": ctx, "cache": kind, "splits_old": s["splits"],
                       "splits_fine": s["fine"], "kv_bytes": kv_bytes, "us": {}}
                for which in ("old", "fine", "engine", *SHORT_CONFIGS):
                    row["us"][which] = time_calls(attention_calls(torch, s, ctx, which)) * 1e3
                row["engine_kernel"] = ("short" if kind == "bf16" and ctx <= 512
                                        and b * KV_HEADS <= RUN.sms else "split_kv")
                row["speedup_engine"] = row["us"]["old"] / row["us"]["engine"]
                row["engine_pct_copy_bw"] = 100 * kv_bytes / (row["us"]["engine"] * 1e-6) / copy_bw
                attn.append(row)
                old, new = (time_calls(block_calls(torch, s, ctx, n, rope)) * 1e3
                            for n in (False, True))
                blocks.append({"batch": b, "context": ctx, "cache": kind, "old_us": old,
                               "new_us": new, "speedup": old / new})
                print(f"  {kind} b={b} ctx={ctx}: " + ", ".join(
                    f"{k} {v:.1f}" for k, v in row["us"].items())
                    + f" | block old {old:.1f} new {new:.1f} us", flush=True)
                del s
                if device == "cuda":
                    torch.cuda.empty_cache()
    return attn, blocks


def markdown(res) -> str:
    m = res["meta"]
    lines = [f"# Decode-step kernels ({m['device']})", "",
             f"{m['date_utc']}, commit {m['commit']}, torch {m['torch']}, triton {m['triton']}. "
             f"Copy bandwidth measured in this run: {res['copy_GBps']:.0f} GB/s. Llama-3-8B "
             "attention (32/8 heads, head_dim 128), pages of 16, bf16 queries. Median us per "
             "call, CUDA-graph replays over copies that stream K/V from HBM.", "",
             "## Correctness", "", "| check | max abs err | ok |", "| --- | ---: | --- |"]
    for k, v in res["correctness"].items():
        err = f"{v['max_abs_err']:.2e}" if "max_abs_err" in v else ""
        lines.append(f"| {k} | {err} | {v['ok']} |")
    lines += ["", f"CUDA-graph replay of the new attention block equals its eager run: "
              f"{res.get('graph_replay_equal')}", "",
              "## Decode attention alone", "",
              "old: split-KV kernel at a decode graph's split count (unsplit up to 512); fine: "
              "the same kernel split into pieces of >= 64 keys; N*w*: the short-context kernel "
              "(first tile of N keys, w warps; _early: earlier steps' K/V read before the wait "
              "on the kernel before, EARLY_KV); engine: what the engine now runs.", "",
              "| cache | batch | context | splits old/fine | old | fine | "
              + " | ".join(SHORT_CONFIGS) + " | engine | engine kernel | speed-up | % copy BW |",
              "| --- | ---: | ---: | ---: | ---: | ---: | " + "---: | " * len(SHORT_CONFIGS)
              + "---: | --- | ---: | ---: |"]
    for r in res["attention"]:
        u = r["us"]
        lines.append(f"| {r['cache']} | {r['batch']} | {r['context']} | {r['splits_old']}/"
                     f"{r['splits_fine']} | {u['old']:.1f} | {u['fine']:.1f} | "
                     + " | ".join(f"{u[k]:.1f}" for k in SHORT_CONFIGS)
                     + f" | {u['engine']:.1f} | {r['engine_kernel']} | {r['speedup_engine']:.2f}x"
                     f" | {r['engine_pct_copy_bw']:.0f}% |")
    lines += ["", "## A layer's attention block (rotary, KV store, attention)", "",
              "| cache | batch | context | old us | new us | speed-up |",
              "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in res["blocks"]:
        lines.append(f"| {r['cache']} | {r['batch']} | {r['context']} | {r['old_us']:.1f} | "
                     f"{r['new_us']:.1f} | {r['speedup']:.2f}x |")
    g = res.get("gemv")
    if g:
        lines += ["", "## Batch-1 GEMV against cuBLAS (kernels/dense_gemv.py; not in the engine)", "",
                  "us (TB/s). Configs: N rows a program, K columns a step, w warps, s stages.", "",
                  "| weight | N x K | cuBLAS | " + " | ".join(GEMV_CONFIGS) + " |",
                  "| --- | --- | ---: | " + "---: | " * len(GEMV_CONFIGS)]
        for r in g["alone"]:
            lines.append(f"| {r['name']} | {r['n']}x{r['k']} | " + " | ".join(
                f"{r['us'][c]:.1f} ({r['TBps'][c]:.2f})" for c in ("cublas", *GEMV_CONFIGS)) + " |")
        lines += ["", "Each weight after the kernel before it in a decode step (which lets a "
                  "GEMV launch early), us per pair; GEMV in its best config above, without and "
                  "with an L2 prefetch of its first 1k / all weight columns before its wait:", "",
                  "| weight | kernel before | that kernel alone | + cuBLAS | + GEMV | "
                  "+ GEMV prefetch 1k | + GEMV prefetch all |",
                  "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
        for name, a in g["after_kernel"].items():
            lines.append(f"| {name} | {a['before']} | {a['alone']:.1f} | {a['cublas']:.1f} | "
                         f"{a['gemv']:.1f} | {a['gemv_prefetch1k']:.1f} | "
                         f"{a['gemv_prefetch_all']:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--smoke", action="store_true", help="CPU dry run, TRITON_INTERPRET=1, tiny shapes")
    ap.add_argument("--commit", default="unknown")
    args = ap.parse_args()
    RUN.smoke = SMOKE = args.smoke
    if SMOKE:
        os.environ["TRITON_INTERPRET"] = "1"   # before triton is first imported
    import torch
    import triton
    from slipstream.analysis.hardware import measure_copy_bandwidth
    if not SMOKE and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --smoke for a CPU dry run")
    device = "cpu" if SMOKE else "cuda"
    # the interpreter has no bf16 dots
    RUN.dtype = DTYPE = torch.float16 if SMOKE else torch.bfloat16
    RUN.sms = 132 if SMOKE else torch.cuda.get_device_properties(0).multi_processor_count
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    res = {"meta": {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke)",
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__, "triton": triton.__version__, "commit": args.commit}}
    print("correctness", flush=True)
    res["correctness"] = correctness(torch, device, [1, 17, 130, 256, 257, 700] if SMOKE else
                                     [1, 17, 128, 130, 255, 256, 257, 700, 4000])
    for k, v in res["correctness"].items():
        print(f"  {k}: {v}", flush=True)
    if device == "cuda":
        res["graph_replay_equal"] = graph_replay_equal(torch, device)
    res["copy_GBps"] = measure_copy_bandwidth(device, nbytes=1 << 20 if SMOKE else None) / 1e9
    print(f"copy bandwidth {res['copy_GBps']:.0f} GB/s [{time.time() - t0:.0f}s]", flush=True)
    grid = ((1,), (40,), ("bf16", "int8")) if SMOKE else (BATCHES, CONTEXTS, CACHES)
    res["attention"], res["blocks"] = timing(torch, device, *grid, res["copy_GBps"] * 1e9)
    print(f"gemv [{time.time() - t0:.0f}s]", flush=True)
    res["gemv"] = gemv(torch, device, DTYPE, SMOKE, time_calls, max_err,
                       lambda *a: setup_case(torch, 1, a[0], "bf16", device, a[1]))
    for r in res["gemv"]["alone"]:
        res["correctness"].update({f"gemv_{r['name']}_{c}": v for c, v in r["check"].items()})
    (args.out / "decode_kernels.json").write_text(json.dumps(res, indent=1))
    (args.out / "decode_kernels.md").write_text(markdown(res))
    ok = all(v["ok"] for v in res["correctness"].values()) and res.get("graph_replay_equal", True)
    print(f"wrote {args.out}/decode_kernels.json and .md in {time.time() - t0:.0f}s; "
          f"correctness {'ok' if ok else 'FAILED'}", flush=True)
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()

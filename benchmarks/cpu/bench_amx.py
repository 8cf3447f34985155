"""AMX tiles (kernels/cpu_amx.c) against the AVX-512 kernels on this CPU, default model.

1. Products: every linear layer of the default model's 30 decoder layers (its own Q4_1
   blocks, repacked as the engine runs them) and the LM head (Q8_0), for m rows of x,
   tiles on and off alternating rep by rep; medians.
2. Prefill through `LLM.generate` (one request, max_tokens=1, prompts of random ids),
   tiles on and off alternating, after prompts that touch the KV pool's pages; medians
   -> prompt tokens/s.

    python benchmarks/cpu/bench_amx.py --out benchmarks/cpu/results

Exits with a note where this CPU, its compiler or the OS gives no AMX tiles.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def _median_ms(fn, reps: int) -> float:
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def products(llm, ms: list[int], reps: int) -> list[dict]:
    import torch
    from slipstream.kernels import cpu_library
    from slipstream.kernels.cpu_quant import QuantMatrix
    model = llm.engine.runner.model

    def blocks(mod):
        w = getattr(mod, "gguf_weight", None)
        return w if isinstance(w, QuantMatrix) else None
    mats = [blocks(mod) for name, mod in model.named_modules()
            if name.startswith("model.layers.") and blocks(mod) is not None]
    head = blocks(model.lm_head) or blocks(model.model.embed_tokens)   # a tied head: the table
    if not mats:
        raise SystemExit("the model's layers hold no CPU blocks (not the GGUF path?)")
    rows = []
    for m in ms:
        xs = {w.cols: torch.randn(m, w.cols) for w in mats + ([head] if head else [])}
        times = {(part, amx): [] for part in ("layers", "lm_head") for amx in (False, True)}
        for _ in range(reps):
            for amx in (False, True):
                cpu_library.set_amx(amx)
                times[("layers", amx)].append(_median_ms(lambda: [w.matmul(xs[w.cols]) for w in mats], 1))
                if head is not None:
                    times[("lm_head", amx)].append(_median_ms(lambda: head.matmul(xs[head.cols]), 1))
        for part in ("layers", "lm_head"):
            if not times[(part, False)]:
                continue
            off, on = (statistics.median(times[(part, a)]) for a in (False, True))
            rows.append({"part": part, "m": m, "avx512_ms": round(off, 3), "amx_ms": round(on, 3),
                         "speedup": round(off / on, 3)})
    cpu_library.set_amx(True)
    return rows


def prefill(llm, lengths: list[int], reps: int) -> list[dict]:
    from slipstream import SamplingParams
    from slipstream.kernels import cpu_library
    params = SamplingParams(max_tokens=1, temperature=0)
    rng = random.Random(0)
    # Warm-up: a prompt's KV blocks are fresh memory until the pool has cycled through
    # them once, and a first write to a page faults (several ms a prompt); fill the
    # pool's pages first so that neither setting pays for them.
    blocks = llm.engine.runner.num_blocks * llm.engine.config.cache.block_size
    for _ in range(min(64, blocks // max(lengths) + 2)):
        llm.generate([{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(max(lengths))]}],
                     params, use_tqdm=False)
    times = {(n, amx): [] for n in lengths for amx in (False, True)}
    for _ in range(reps):
        for amx in (False, True):
            cpu_library.set_amx(amx)
            for n in lengths:
                ids = [rng.randrange(100, 40000) for _ in range(n)]
                times[(n, amx)].append(_median_ms(lambda: llm.generate(
                    [{"prompt_token_ids": ids}], params, use_tqdm=False), 1))
    cpu_library.set_amx(True)
    rows = []
    for n in lengths:
        off, on = (statistics.median(times[(n, a)]) for a in (False, True))
        rows.append({"prompt_tokens": n, "avx512_tok_s": round(n / off * 1e3, 1),
                     "amx_tok_s": round(n / on * 1e3, 1), "speedup": round(off / on, 3)})
    return rows


def markdown(meta: dict, prod: list[dict], pre: list[dict]) -> str:
    lines = [f"# AMX tiles against AVX-512, default model ({meta['cpu']})", "",
             f"{meta['date']}, {meta['threads']} threads, torch {meta['torch']}, commit "
             f"{meta['commit']}; load average {meta['load_before']} -> {meta['load_after']}. "
             "Tiles on and off alternating rep by rep; medians.", "",
             "## Products (30 decoder layers' Q4_1 products, or the Q8_0 LM head)", "",
             "| part | rows of x | AVX-512 ms | AMX ms | speedup |", "| --- | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['part']} | {r['m']} | {r['avx512_ms']} | {r['amx_ms']} | {r['speedup']} |"
              for r in prod]
    lines += ["", "## Prefill through `LLM.generate` (one request, max_tokens=1)", "",
              "| prompt tokens | AVX-512 tok/s | AMX tok/s | speedup |", "| ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['prompt_tokens']} | {r['avx512_tok_s']} | {r['amx_tok_s']} | {r['speedup']} |"
              for r in pre]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--ms", default="1,4,8,12,16,32,64")
    ap.add_argument("--prompts", default="32,128,512")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    import subprocess
    import torch
    from slipstream import LLM
    from slipstream.kernels import cpu_library
    llm = LLM()
    if not cpu_library.set_amx():
        print("no AMX tiles here (CPU, compiler or OS); nothing to compare")
        return 0
    load_before = os.getloadavg()[0]
    prod = products(llm, [int(m) for m in args.ms.split(",")], args.reps)
    pre = prefill(llm, [int(n) for n in args.prompts.split(",")], args.reps)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip() or "unknown"
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "cpu": platform.processor() or platform.machine(), "threads": cpu_library.threads(),
            "torch": torch.__version__, "commit": commit, "load_before": round(load_before, 2),
            "load_after": round(os.getloadavg()[0], 2)}
    md = markdown(meta, prod, pre)
    print(md)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        stem = f"amx_{meta['date'][:10]}_{commit}"
        (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "products": prod, "prefill": pre},
                                                      indent=1))
        (out / f"{stem}.md").write_text(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What a verification step costs on the CPU: one step of the default model
(the one-call C decoder) bringing n tokens of one sequence (1 + n - 1 drafts,
a chain) after `--context` cached tokens, final norm and LM head included,
against the one-token step. Wall time with the kernels' threads, and the
calling thread's CPU time with one thread (less moved by other people's work
on a shared machine), and the wall time of the model's layer-by-layer forward
(where verification steps went before the C decoder took them). The n's
alternate rep by rep; medians.

    python benchmarks/spec/cpu_verify_cost.py --context 150 --out benchmarks/spec/results
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))


def _measure(model, ctx: int, sizes: list[int], reps: int, clock) -> dict[int, float]:
    import torch
    from tests.models.batch_builder import BlockAllocator, Sequence, allocate_kv_caches, make_batch
    blocks = (ctx + max(sizes)) // 16 + 2
    allocate_kv_caches(model, blocks, 16, torch.float32)
    seq = Sequence(list(range(100, 100 + ctx + max(sizes))), 16, BlockAllocator(blocks))
    times: dict[int, list[float]] = {n: [] for n in sizes}
    with torch.inference_mode():
        pre = make_batch([(seq, ctx)])
        model.backend.prepare(pre)
        model(pre)
        batches = {}
        for n in sizes:
            seq.num_computed = ctx
            batches[n] = make_batch([(seq, n)])
        for _ in range(reps):
            for n in sizes:
                b = batches[n]
                t = clock()
                model.backend.prepare(b)
                model.compute_logits(model(b))
                times[n].append(clock() - t)
    return {n: statistics.median(ts) for n, ts in times.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=150)
    ap.add_argument("--sizes", default="1,2,3,5,9,13,17")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from slipstream import LLM
    from slipstream.kernels import cpu_decoder, cpu_library
    sizes = [int(s) for s in args.sizes.split(",")]
    llm = LLM(device="cpu", max_model_len=max(1024, args.context + 64))
    model = llm.engine.runner.model
    threads = cpu_library.threads()
    load = [os.getloadavg()[0]]
    wall = _measure(model, args.context, sizes, args.reps, time.perf_counter)
    cpu_decoder.enabled = False
    torch_fwd = _measure(model, args.context, sizes, max(args.reps // 3, 3), time.perf_counter)
    cpu_decoder.enabled = True
    cpu_library.set_threads(1)
    cpu = _measure(model, args.context, sizes, args.reps, time.thread_time)
    cpu_library.set_threads(threads)
    load.append(os.getloadavg()[0])
    rows = [dict(tokens=n, wall_ms=round(wall[n] * 1e3, 2), wall_vs_one=round(wall[n] / wall[1], 2),
                 cpu1_ms=round(cpu[n] * 1e3, 2), cpu1_vs_one=round(cpu[n] / cpu[1], 2),
                 forward_ms=round(torch_fwd[n] * 1e3, 2)) for n in sizes]
    date = datetime.date.today().isoformat()
    env = dict(date=date, context=args.context, threads=threads, reps=args.reps, load_average=load)
    lines = [f"# CPU verification step cost ({date})", "",
             f"Default model, one sequence, {args.context} cached tokens, a chain of n tokens in one step "
             f"(norms, products, attention, KV store, final norm, LM head); medians of {args.reps} reps, "
             f"the n's alternating. Load average {load[0]:.1f} -> {load[1]:.1f} (2 cores, shared).", "",
             f"| tokens | wall ms ({threads} threads) | vs 1 token | CPU ms (1 thread) | vs 1 token | "
             f"layer-by-layer forward, wall ms ({threads} threads) |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['tokens']} | {r['wall_ms']} | {r['wall_vs_one']} | {r['cpu1_ms']} | {r['cpu1_vs_one']} | "
              f"{r['forward_ms']} |" for r in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"cpu_verify_cost_{date}.json").write_text(json.dumps(dict(env=env, rows=rows), indent=1))
        (out / f"cpu_verify_cost_{date}.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

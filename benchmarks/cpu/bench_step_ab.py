"""The one-call CPU step of the default model built at two revisions, in one process.

    python benchmarks/cpu/bench_step_ab.py --base HEAD~1 [--context 150] [--sizes 1,4]
        [--blocks 20] [--steps 25] [--out DIR]

The C kernels (slipstream/kernels/*.c) are built twice: as they are in the working
tree, and as they were at --base (`git show`). The model is loaded once; its
one-call decoder then runs the same step with either library, in blocks of
--steps steps, the two alternating block by block (so a drift of a shared
machine hits both alike). A step of n tokens: n = 1 is a decode step
(`ss_decode_step`), n > 1 a chain of n tokens verified in one call
(`ss_tree_step`, a draft check), both after --context cached tokens, LM head
excluded. Reported per n: the median ms a step of each build, the ratio, and
the largest difference between the two builds' outputs beside the largest
output (where the kernels sum in another order the fp32 results differ in their
last bits, and an activation's int8 code can then round the other way: such
differences grow through the layers as rounding noise does).

Each library has its own thread pool; a pool's worker sleeps 0.5 ms after its
last job, so the idle build's pool is asleep through the other's block.
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def _build_at(rev: str, out_dir: Path) -> Path:
    """The kernels' sources at git revision rev, compiled as cpu_library builds them."""
    from slipstream.kernels import cpu_library as cl
    src = out_dir / rev.replace("/", "_").replace("~", "_")
    src.mkdir(parents=True, exist_ok=True)
    for p in [cl._SOURCE, *cl._INCLUDED]:
        rel = p.relative_to(ROOT).as_posix()
        text = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{rel}"], capture_output=True,
                              text=True, check=True).stdout
        (src / p.name).write_text(text)
    so = src / "cpu_quant.so"
    subprocess.run([cl._compiler(), *cl._FLAGS, "-o", str(so), str(src / cl._SOURCE.name)], check=True)
    return so


def _load(so: Path, threads: int):
    from slipstream.kernels import cpu_library as cl
    lib = ctypes.CDLL(str(so))
    for name, (args, res) in cl._SIGNATURES.items():
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.argtypes, fn.restype = args, res
    lib.ss_set_threads(threads)
    return lib


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="git revision of the baseline kernels")
    ap.add_argument("--context", type=int, default=150)
    ap.add_argument("--sizes", default="1,4")
    ap.add_argument("--blocks", type=int, default=20)
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import torch
    from slipstream import LLM
    from slipstream.kernels import cpu_library
    from tests.models.batch_builder import BlockAllocator, Sequence, allocate_kv_caches, make_batch

    llm = LLM()
    threads = cpu_library.set_threads(None)
    model = llm.engine.runner.model
    with tempfile.TemporaryDirectory() as tmp:
        base_so = _build_at(args.base, Path(tmp))
        libs = {"base": _load(base_so, threads), "new": cpu_library.load()}
        sizes = [int(s) for s in args.sizes.split(",")]
        ctx = args.context
        blocks = (ctx + max(sizes)) // 16 + 2
        allocate_kv_caches(model, blocks, 16, torch.float32)
        seq = Sequence(list(range(100, 100 + ctx + max(sizes))), 16, BlockAllocator(blocks))
        rows = []
        with torch.inference_mode():
            pre = make_batch([(seq, ctx)])
            model.backend.prepare(pre)
            model(pre)
            decoder = model.model.cpu_decoder     # built at the first forward
            if not decoder:
                raise SystemExit("the one-call CPU decoder does not run here")
            for n in sizes:
                seq.num_computed = ctx
                batch = make_batch([(seq, n)])
                outs, times = {}, {k: [] for k in libs}
                for name, lib in libs.items():       # warm up; each build's output
                    decoder._lib = lib
                    for _ in range(5):
                        model.backend.prepare(batch)
                        outs[name] = model(batch).clone()
                for b in range(args.blocks):
                    order = list(libs) if b % 2 == 0 else list(libs)[::-1]
                    for name in order:
                        decoder._lib = libs[name]
                        t = time.perf_counter()
                        for _ in range(args.steps):
                            model.backend.prepare(batch)
                            model(batch)
                        times[name].append((time.perf_counter() - t) / args.steps * 1e3)
                base, new = statistics.median(times["base"]), statistics.median(times["new"])
                rows.append(dict(tokens=n, base_ms=round(base, 3), new_ms=round(new, 3),
                                 speedup=round(base / new, 3),
                                 max_abs_diff=float((outs["base"] - outs["new"]).abs().max()),
                                 max_abs_out=float(outs["base"].abs().max()),
                                 base_blocks=[round(x, 3) for x in times["base"]],
                                 new_blocks=[round(x, 3) for x in times["new"]]))
                print(f"{n} tokens: base {base:.3f} ms, new {new:.3f} ms a step ({base / new:.2f}x); "
                      f"outputs differ by at most {rows[-1]['max_abs_diff']:.2e} (largest |output| "
                      f"{rows[-1]['max_abs_out']:.2e})")
        decoder._lib = libs["new"]
    rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", args.base], capture_output=True,
                         text=True).stdout.strip()
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "slipstream/kernels"],
                           capture_output=True, text=True).stdout.strip()
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")),
               platform.processor())
    meta = dict(date=datetime.date.today().isoformat(), cpu=cpu, threads=threads, torch=torch.__version__,
                base=f"{args.base} ({rev})", new=f"{head}{' + working tree' if dirty else ''}",
                context=ctx, blocks=args.blocks, steps_per_block=args.steps)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "step_ab.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
        lines = [f"# The one-call CPU step, two builds in one process ({meta['date']})", "",
                 f"{cpu}, {threads} threads, torch {torch.__version__}; default model (SmolLM2-135M-Instruct "
                 f"Q4_1 GGUF), one sequence after {ctx} cached tokens, LM head excluded; median of "
                 f"{args.blocks} blocks of {args.steps} steps, the builds alternating block by block. "
                 f"Base: {meta['base']}; new: {meta['new']}.", "",
                 "| tokens a step | base ms | new ms | speedup | largest output difference | largest output |",
                 "| ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in rows:
            lines.append(f"| {r['tokens']} | {r['base_ms']} | {r['new_ms']} | {r['speedup']}x | "
                         f"{r['max_abs_diff']:.2e} | {r['max_abs_out']:.2e} |")
        (out / "step_ab.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""KIVI KV caches on the CPU: decode speed of the default model with `kv_cache_dtype`
auto (the fp32 cache), kivi4 and kivi2, through `slipstream bench latency` (batch 1,
64 decode steps after a prompt of 512 or 2,048 tokens), each in its own process,
the kinds alternating, medians of the repetitions. --before DIR adds one kivi4 run
of another checkout of slipstream (e.g. `git worktree add DIR COMMIT`) a prompt length.

    python benchmarks/cpu/kivi_decode_ab.py --out DIR [--reps 3] [--before DIR]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(src: Path, kv: str, length: int, out: Path) -> float:
    env = dict(os.environ, PYTHONPATH=str(src))
    subprocess.run([sys.executable, "-m", "slipstream.cli", "bench", "latency", "--kv-cache-dtype", kv,
                    "--input-len", str(length), "--output-len", "64", "--batch-size", "1",
                    "--num-iters", "3", "--output-json", str(out)], cwd=src, env=env, check=True,
                   capture_output=True)
    return json.loads(out.read_text())["decode_step_s"] * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--before", default=None, help="another checkout: its kivi4 runs too")
    args = ap.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    kinds = [("now", ROOT, kv) for kv in ("auto", "kivi4", "kivi2")]
    if args.before:
        kinds.append(("before", Path(args.before), "kivi4"))
    times: dict[str, list[float]] = {}
    for rep in range(args.reps):
        for length in (512, 2048):
            for tag, src, kv in kinds:
                if tag == "before" and rep:
                    continue          # (the path it replaces is slow: measured once)
                key = f"{tag} {kv} {length}"
                ms = run(src, kv, length, out / f"{tag}_{kv}_{length}_r{rep}.json")
                times.setdefault(key, []).append(ms)
                print(f"{key} rep {rep}: {ms:.2f} ms a step", flush=True)
    rows = []
    for key, ts in times.items():
        tag, kv, length = key.split()
        base = statistics.median(times[f"now auto {length}"])
        med = statistics.median(ts)
        rows.append(dict(code=tag, kv_cache_dtype=kv, prompt=int(length), ms_per_step=round(med, 2),
                         all_ms=[round(t, 2) for t in ts], x_fp32_cache=round(base / med, 2)))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    meta = dict(date=datetime.date.today().isoformat(), machine=platform.processor() or platform.machine(),
                cpus=os.cpu_count(), commit=commit, before=args.before)
    (out / "kivi_decode_cpu.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    lines = ["| code | kv cache | prompt | ms a decode step (median) | x the fp32 cache |", "|---|---|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: (r["prompt"], r["code"] != "now", r["kv_cache_dtype"])):
        lines.append(f"| {r['code']} | {r['kv_cache_dtype']} | {r['prompt']} | {r['ms_per_step']} | {r['x_fp32_cache']} |")
    (out / "kivi_decode_cpu.md").write_text(f"{meta}\n\n" + "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Speculative decoding on a shared CPU: `slipstream bench spec` run several
times in a row (each run already alternates plain and speculative decoding
prompt by prompt), the median of the runs per method and configuration, and
the machine's load average around each run (other people's work on the same
cores moves single runs by tens of percent).

    python benchmarks/spec/cpu_median.py --runs 3 --num-prompts 8 --max-tokens 96 \
        --config default: --config small:"--eagle-tree 1,1,3 --eagle-depth 3 --medusa-tree 1,1 --ngram-tokens 3"

Each --config is NAME:EXTRA-ARGS (arguments of `bench spec`, after any NAME=VALUE
words for its environment, e.g. `SLIPSTREAM_CPU_SAMPLED_DRAFTS=0 --temperature 0.7`). Writes
results_cpu_<date>.{json,md} to --out (default benchmarks/spec/results).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
KEYS = ("tokens_per_s", "plain_tokens_per_s", "speedup", "tau", "mean_accepted", "drafted_per_round",
        "identical")


def _commit() -> str:
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return r.stdout.strip() or "unknown"


def _one(extra: list[str], common: list[str]) -> tuple[list[dict], float, float]:
    """One `bench spec` run; leading NAME=VALUE words of `extra` go to its environment."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    while extra and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", extra[0]):
        name, value = extra[0].split("=", 1)
        env[name] = value
        extra = extra[1:]
    with tempfile.TemporaryDirectory() as out:
        before = os.getloadavg()[0]
        cmd = [sys.executable, "-m", "slipstream.cli", "bench", "spec", *common, *extra, "--out", out]
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
        after = os.getloadavg()[0]
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {r.stderr[-2000:]}")
        data = json.loads((Path(out) / "results_cpu.json").read_text())
    return data["results"], before, after


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--methods", default="ngram,eagle,medusa")
    ap.add_argument("--config", action="append", default=None, help="NAME:EXTRA-ARGS (repeatable)")
    ap.add_argument("--out", default=str(HERE / "results"))
    args = ap.parse_args(argv)
    configs = [c.split(":", 1) for c in (args.config or ["default:"])]
    common = ["--device", "cpu", "--speculative-method", args.methods, "--num-prompts",
              str(args.num_prompts), "--max-tokens", str(args.max_tokens)]
    runs: dict[str, list] = {name: [] for name, _ in configs}
    loads = []
    for i in range(args.runs):            # configurations alternate run by run
        for name, extra in configs:
            rows, before, after = _one(shlex.split(extra), common)
            runs[name].append(rows)
            loads.append((name, i, round(before, 2), round(after, 2)))
            print(json.dumps(dict(config=name, run=i, load=[before, after], rows=rows)), flush=True)
    table = []
    for name, extra in configs:
        by_method: dict[str, list[dict]] = {}
        for rows in runs[name]:
            for r in rows:
                by_method.setdefault(r["method"], []).append(r)
        for method, rs in by_method.items():
            row = dict(config=name, extra=extra, method=method, runs=len(rs),
                       options=rs[0].get("options"))
            for k in KEYS:
                vals = [r[k] for r in rs if r.get(k) is not None]
                if vals:
                    row[k] = round(statistics.median(vals), 3)
                    row[k + "_all"] = vals
            table.append(row)
    date = datetime.date.today().isoformat()
    env = dict(commit=_commit(), date=date, cpus=os.cpu_count(), prompts=args.num_prompts,
               max_tokens=args.max_tokens, runs=args.runs, load_average=loads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"results_cpu_{date}.json").write_text(json.dumps(dict(env=env, results=table), indent=1))
    lo = min(min(b, a) for _, _, b, a in loads)
    hi = max(max(b, a) for _, _, b, a in loads)
    lines = [f"# Speculative decoding on the CPU, batch 1 ({date}, commit {env['commit']})", "",
             f"SmolLM2-135M-Instruct Q4_1 GGUF, {args.num_prompts} chat prompts of "
             "benchmarks/spec/prompts.txt, "
             f"{args.max_tokens} tokens each, {os.cpu_count()} CPU threads; the median of {args.runs} runs of "
             "`slipstream bench spec` per configuration (runs alternate between configurations; each run "
             "alternates plain and speculative decoding prompt by prompt; greedy unless a configuration "
             "names --temperature). Shared machine: 1-minute load "
             f"average {lo:.1f} to {hi:.1f} around the runs (2 cores).", "",
             "| config | method | tok/s | plain tok/s | speedup (median) | speedups (runs) | tau | "
             "drafted/round | identical |", "|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        lines.append(f"| {r['config']} | {r['method']} | {r.get('tokens_per_s', '')} | "
                     f"{r.get('plain_tokens_per_s', '')} | {r.get('speedup', '')} | "
                     f"{r.get('speedup_all', '')} | {r.get('tau', '')} | {r.get('drafted_per_round', '')} | "
                     f"{r.get('identical', '')} |")
    lines += ["", "Configurations: " + "; ".join(f"{n}: `{e or 'bench defaults'}`" for n, e in configs)]
    (out / f"results_cpu_{date}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

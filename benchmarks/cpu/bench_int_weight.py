"""Weight-only schemes on the CPU: the layers' codes as GGUF blocks for the CPU kernels
(quant/cpu_blocks.py, the default) against the exact products in PyTorch
(SLIPSTREAM_CPU_BLOCKS=0: every product dequantizes its weight), on the default model
(its Q4_1 file dequantized, then quantized again by the scheme at load; float32
activations). Each configuration is one process of `slipstream bench latency` (batch 1,
32-token random prompt; decode tokens/s), rounds interleaved; then perplexity by
`slipstream eval ppl` over the first 6,000 characters of benchmarks/quant/eval_text.txt
in both modes, and the GGUF file itself as the reference.

    python benchmarks/cpu/bench_int_weight.py --out benchmarks/cpu/results   # ~10 min, 2 cores
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCHEMES = ["rtn-int4", "rtn-int4-head8", "int8"]
# The exact products are slow: fewer tokens keep the run short (tokens/s is per step).
OUTPUT_LEN = {"blocks": 64, "exact": 8}


def _run(args: list[str], blocks: bool) -> str:
    env = dict(os.environ, SLIPSTREAM_CPU_BLOCKS="1" if blocks else "0", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "slipstream.cli", *args], capture_output=True,
                       text=True, env=env, cwd=ROOT, timeout=900)
    if r.returncode:
        raise RuntimeError(f"{' '.join(args)} failed:\n{r.stderr[-2000:]}")
    return r.stdout + r.stderr


def decode_tps(scheme: str, mode: str) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "lat.json"
        _run(["bench", "latency", "--batch-size", "1", "--input-len", "32", "--output-len",
              str(OUTPUT_LEN[mode]), "--num-iters", "2", "--dtype", "float32",
              "--quantization", scheme, "--output-json", str(out)], mode == "blocks")
        return json.loads(out.read_text())["decode_tokens_per_s"]


def perplexity(scheme: str | None, blocks: bool, text: Path) -> float:
    args = ["eval", "ppl", "--text", str(text), "--context", "512", "--dtype", "float32"]
    printed = _run(args + (["--quantization", scheme] if scheme else []), blocks)
    return float(re.search(r"perplexity ([0-9.]+)", printed).group(1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks/cpu/results"))
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    samples = {(s, m): [] for s in SCHEMES for m in ("blocks", "exact")}
    for r in range(args.rounds):
        for key in samples:
            samples[key].append(decode_tps(*key))
            print(f"round {r}: {key[0]} {key[1]} {samples[key][-1]:.1f} tok/s", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "eval.txt"
        text.write_text((ROOT / "benchmarks/quant/eval_text.txt").read_text()[:6000])
        ppl = {"gguf file (Q4_1 blocks)": perplexity(None, True, text),
               "rtn-int4, blocks": perplexity("rtn-int4", True, text),
               "rtn-int4, exact": perplexity("rtn-int4", False, text)}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=ROOT).stdout.strip()
    meta = dict(date=datetime.date.today().isoformat(), commit=commit, cpu=platform.processor()
                or platform.machine(), cores=os.cpu_count(), python=platform.python_version(),
                load_average=os.getloadavg())
    rows = ["| scheme | blocks tok/s | exact tok/s | x exact |", "| --- | ---: | ---: | ---: |"]
    for s in SCHEMES:
        b, e = (statistics.median(samples[s, m]) for m in ("blocks", "exact"))
        rows.append(f"| {s} | {b:.1f} | {e:.1f} | {b / e:.1f} |")
    md = [f"# Weight-only schemes on the CPU: GGUF blocks vs exact products ({meta['date']}, "
          f"commit {commit})", "", f"- machine: {meta['cpu']}, {meta['cores']} cores; "
          f"load average at the end {meta['load_average']}",
          "- default model, float32 activations, batch 1, 32-token prompt; medians of "
          f"{args.rounds} interleaved rounds (decode tokens/s)", "", *rows, "",
          "Perplexity (first 6,000 characters of benchmarks/quant/eval_text.txt, windows of 512):",
          "", *[f"- {k}: {v:.4f}" for k, v in ppl.items()], "",
          "Samples: " + "; ".join(f"{s} {m} " + " ".join(f"{v:.1f}" for v in vals)
                                  for (s, m), vals in samples.items())]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"int_weight_blocks_{meta['date']}_{commit}"
    (out / f"{stem}.md").write_text("\n".join(md) + "\n")
    (out / f"{stem}.json").write_text(json.dumps(dict(meta=meta, samples={
        f"{s}/{m}": v for (s, m), v in samples.items()}, perplexity=ppl), indent=1))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())

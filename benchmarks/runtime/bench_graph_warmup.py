"""CUDA graphs captured before serving (`engine/warmup.capture_graphs`, what
`slipstream serve` does at start-up) against capture on first use, Llama-3-8B
shape, random bf16 weights: the start-up time it costs, and the slowest steps
of a first pass of 1,000 ShareGPT-like requests (all submitted at once) with
and without it, each in its own engine.

    python benchmarks/runtime/bench_graph_warmup.py --out DIR

Writes DIR/graph_warmup.json: per setting, the capture's seconds, the pass's
elapsed seconds, its slowest steps (ms, kind, index), the step-time median by
kind and the graphs captured during the pass.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[2])]
from bench_engine import _llm, _requests, _timed_steps   # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    import torch
    from slipstream.engine.warmup import capture_graphs

    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d")}
    for name in ("first_use", "captured_ahead"):
        t0 = time.perf_counter()
        llm = _llm()
        built = time.perf_counter() - t0
        runner = llm.engine.runner
        cap = capture_graphs(llm.engine) if name == "captured_ahead" else None
        before = (len(runner.graphs.graphs), len(runner.piecewise.pieces))
        run = _timed_steps(llm, _requests(seed=3))
        after = (len(runner.graphs.graphs), len(runner.piecewise.pieces))
        res[name] = {"engine_build_s": built, "capture": cap, "pass": run,
                     "decode_graphs_during_pass": after[0] - before[0],
                     "prompt_buckets_during_pass": after[1] - before[1]}
        print(name, json.dumps(res[name])[:1500], flush=True)
        llm.shutdown()
        del llm, runner
        gc.collect()
        torch.cuda.empty_cache()
    (out / "graph_warmup.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

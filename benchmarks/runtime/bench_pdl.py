"""Early launch of the row-wise kernels (norms, SiLU x up, rotary + KV store),
against plain launches, in one process (Llama-3-8B shape, random bf16 weights).

With programmatic dependent launch a kernel may start before the one ahead of it
in the stream ends; it waits (`griddepcontrol.wait`) only before it touches that
kernel's outputs. The row-wise kernels of a decode step are a few microseconds
each, about as long as the launch gap before them, so each boundary they hide
counts. `kernels/runtime.EARLY_ELEMENTWISE` switches them (off by default since
this benchmark's first run); the decode graphs and
the piecewise prompt graphs are kept per setting (each captured under its own
setting) and swapped in, and the settings alternate over the repeats, so a drift
of the machine hits both alike.

    python benchmarks/runtime/bench_pdl.py --out DIR [--repeats 3] [--batches 1,8,64]
        [--throughput-repeats 2]        # 0: decode latency only

Writes DIR/pdl.json and DIR/pdl.md: decode tokens/s and step / roofline per
setting and batch (median over the repeats, each repeat listed), tokens equal
between the settings, and the 1,000-request throughput run (output tokens/s, % of
the roofline bound) per setting.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[2])]
from bench_engine import NUM_PROMPTS, _llm, _requests, _timed_steps   # noqa: E402

SETTINGS = {"early": True, "plain": False}


class _Setting:
    """Each setting's captured graphs, swapped into the runner with the switch."""

    def __init__(self, runner):
        self.runner = runner
        self.store = {name: ({}, {}) for name in SETTINGS}

    def use(self, name: str) -> None:
        from slipstream.kernels import runtime
        runtime.EARLY_ELEMENTWISE = SETTINGS[name]
        decode, pieces = self.store[name]
        self.runner.graphs.graphs = decode
        if self.runner.piecewise is not None:
            self.runner.piecewise.pieces = pieces


def _greedy_tokens(llm) -> list[list[int]]:
    from slipstream import SamplingParams
    llm.reset_prefix_cache()       # both settings compute the prompts whole
    prompts = [{"prompt_token_ids": [(7 * i + 13 * j) % 120000 + 1 for j in range(40 + 9 * i)]}
               for i in range(6)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--throughput-repeats", type=int, default=2)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    import torch
    import triton
    from slipstream.analysis.hardware import (HardwareProfile, measure_copy_bandwidth,
                                              measure_matmul_rate)
    from slipstream.bench import latency, throughput

    t0 = time.perf_counter()
    llm = _llm()
    engine = llm.engine
    setting = _Setting(engine.runner)
    dev = torch.device("cuda")
    bw = measure_copy_bandwidth(dev)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__, "date": time.strftime("%Y-%m-%d"),
           "copy_bandwidth_GBps": bw / 1e9, "decode": {n: {} for n in SETTINGS}, "tokens": {}}
    print(f"engine ready {time.perf_counter() - t0:.0f} s, copy bandwidth {bw / 1e9:.0f} GB/s",
          flush=True)

    for name in SETTINGS:
        setting.use(name)
        res["tokens"][name] = _greedy_tokens(llm)
    res["tokens_equal"] = res["tokens"]["early"] == res["tokens"]["plain"]
    print("greedy tokens equal:", res["tokens_equal"], flush=True)

    batches = [int(b) for b in a.batches.split(",")]
    names = list(SETTINGS)
    for rep in range(a.repeats):
        for name in (names if rep % 2 == 0 else names[::-1]):
            setting.use(name)
            for b in batches:
                args = SimpleNamespace(batch_size=b, input_len=128, output_len=128,
                                       num_iters_warmup=1, num_iters=3, dataset_seed=b)
                llm.reset_prefix_cache()   # the repeats' prompts are the same
                r = latency.run(engine, args, bw)
                r["step_over_roofline"] = r["decode_step_s"] / (r["decode_step_bytes"] / bw)
                res["decode"][name].setdefault(str(b), []).append(r)
                print(f"rep {rep} {name} batch {b}: {r['decode_tokens_per_s']:.1f} tok/s, "
                      f"step {1e3 * r['decode_step_s']:.3f} ms "
                      f"({r['step_over_roofline']:.3f}x roofline)", flush=True)

    (out / "pdl.json").write_text(json.dumps(res, indent=1))   # kept if the rest runs out of time
    if a.throughput_repeats:
        hw = HardwareProfile("H200", bw, measure_matmul_rate(dev, torch.bfloat16),
                             source="measured in this process")
        targs = SimpleNamespace(dataset="sharegpt-like", num_prompts=NUM_PROMPTS, dataset_seed=0,
                                input_len=None, output_len=None)
        res["throughput"] = {n: [] for n in SETTINGS}
        for name in names:          # a first pass per setting: its graphs are captured
            setting.use(name)
            llm.reset_prefix_cache()
            _timed_steps(llm, _requests(seed=1))
            print(f"{name}: cold pass done ({time.perf_counter() - t0:.0f} s)", flush=True)
        for rep in range(a.throughput_repeats):
            for name in (names if rep % 2 == 0 else names[::-1]):
                setting.use(name)
                llm.reset_prefix_cache()   # the same prompts each time: no hits from the last run
                r = throughput.run(llm, targs, hw)
                res["throughput"][name].append(
                    {k: r[k] for k in ("elapsed_s", "output_tokens_per_s", "num_steps")}
                    | {"pct_of_bound": r["roofline"]["pct_of_bound"]})
                print(f"throughput rep {rep} {name}: {r['output_tokens_per_s']:.0f} output tok/s, "
                      f"{r['roofline']['pct_of_bound']:.1f}% of the bound", flush=True)

    (out / "pdl.json").write_text(json.dumps(res, indent=1))
    (out / "pdl.md").write_text(_report(res))
    print(_report(res), flush=True)
    return 0


def _report(res: dict) -> str:
    lines = [f"# Early launch of the row-wise kernels ({res['date']}, {res['device']}, "
             f"torch {res['torch']}, triton {res['triton']})", "",
             f"Llama-3-8B shape, random bf16 weights, 128-token prompts, 128 outputs, greedy; "
             f"copy bandwidth {res['copy_bandwidth_GBps']:.0f} GB/s in the process. "
             f"Greedy tokens equal between the settings: {res['tokens_equal']}.", "",
             "| batch | plain tok/s (repeats) | early tok/s (repeats) | early / plain | "
             "step / roofline, plain -> early |", "| ---: | --- | --- | ---: | --- |"]
    for b in res["decode"]["early"]:
        row = {}
        for name in SETTINGS:
            runs = res["decode"][name][b]
            row[name] = (statistics.median(r["decode_tokens_per_s"] for r in runs),
                         [round(r["decode_tokens_per_s"], 1) for r in runs],
                         statistics.median(r["step_over_roofline"] for r in runs))
        lines.append(f"| {b} | {row['plain'][0]:.1f} {row['plain'][1]} | {row['early'][0]:.1f} "
                     f"{row['early'][1]} | {row['early'][0] / row['plain'][0]:.3f}x | "
                     f"{row['plain'][2]:.3f} -> {row['early'][2]:.3f} |")
    if "throughput" in res:
        lines += ["", "| 1,000 ShareGPT-like requests | output tok/s (repeats) | % of the bound |",
                  "| --- | --- | --- |"]
        for name in SETTINGS:
            runs = res["throughput"][name]
            lines.append(f"| {name} | {[round(r['output_tokens_per_s']) for r in runs]} | "
                         f"{[round(r['pct_of_bound'], 1) for r in runs]} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())

"""One engine, two or more settings of a switch that changes the decode step's kernels,
alternated in one process (Llama-3-8B shape, random bf16 weights).

The decode graphs and the piecewise prompt graphs are kept per setting (each captured
under its own setting) and swapped in, and the settings alternate over the repeats,
so a drift of the machine hits them alike. The switches (`SWITCHES`):
  * pdl: early launch of the row-wise kernels (norms, SiLU x up, rotary + KV store)
    under programmatic dependent launch, against plain launches
    (`kernels/runtime.EARLY_ELEMENTWISE`);
  * skinny: the 2-32-row products of qkv and o_proj (and gate_up) through the
    tensor-core skinny GEMM instead of cuBLAS (`layers/few_rows.ROLES`).

    python benchmarks/runtime/bench_switch.py --switch pdl --out DIR [--repeats 3]
        [--batches 1,8,64] [--throughput-repeats 2]     # 0: decode latency only
        [--settings plain,early]                        # a subset, the baseline first

Writes DIR/SWITCH.json and DIR/SWITCH.md: decode tokens/s and step / roofline per
setting and batch (median over the repeats, each repeat listed), greedy tokens of
each setting against the first's, and the 1,000-request throughput run (output
tokens/s, % of the roofline bound) per setting.
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

def _pdl(on: bool):
    def use():
        from slipstream.kernels import runtime
        runtime.EARLY_ELEMENTWISE = on
    return use


def _skinny(*roles: str):
    def use():
        from slipstream.layers import few_rows
        few_rows.ROLES = frozenset(roles)
    return use


# switch -> {setting: what turns it on}; the first setting is the baseline.
SWITCHES = {
    "pdl": {"plain": _pdl(False), "early": _pdl(True)},
    "skinny": {"cublas": _skinny(), "qkv_o": _skinny("qkv", "o"),
               "qkv_o_gate_up": _skinny("qkv", "o", "gate_up")},
}


class _Setting:
    """Each setting's captured graphs, swapped into the runner with the switch."""

    def __init__(self, runner, settings: dict):
        self.runner = runner
        self.settings = settings
        self.store = {name: ({}, {}) for name in settings}

    def use(self, name: str) -> None:
        self.settings[name]()
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
    ap.add_argument("--switch", choices=sorted(SWITCHES), required=True)
    ap.add_argument("--settings", help="a comma list of the switch's settings (default all; "
                    "the first is the baseline)")
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
    settings = SWITCHES[a.switch]
    if a.settings:
        settings = {n: settings[n] for n in a.settings.split(",")}
    names = list(settings)
    setting = _Setting(engine.runner, settings)
    dev = torch.device("cuda")
    bw = measure_copy_bandwidth(dev)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__, "date": time.strftime("%Y-%m-%d"),
           "copy_bandwidth_GBps": bw / 1e9, "switch": a.switch,
           "decode": {n: {} for n in names}, "tokens": {}}
    print(f"engine ready {time.perf_counter() - t0:.0f} s, copy bandwidth {bw / 1e9:.0f} GB/s",
          flush=True)

    for name in names:
        setting.use(name)
        res["tokens"][name] = _greedy_tokens(llm)
    res["tokens_equal"] = {n: _agreement(res["tokens"][names[0]], res["tokens"][n])
                           for n in names[1:]}
    print("greedy tokens equal to the baseline's (equal / all):", res["tokens_equal"], flush=True)

    batches = [int(b) for b in a.batches.split(",")]
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

    stem = out / a.switch
    stem.with_suffix(".json").write_text(json.dumps(res, indent=1))   # kept if the rest runs out of time
    if a.throughput_repeats:
        hw = HardwareProfile("H200", bw, measure_matmul_rate(dev, torch.bfloat16),
                             source="measured in this process")
        targs = SimpleNamespace(dataset="sharegpt-like", num_prompts=NUM_PROMPTS, dataset_seed=0,
                                input_len=None, output_len=None)
        res["throughput"] = {n: [] for n in names}
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

    stem.with_suffix(".json").write_text(json.dumps(res, indent=1))
    stem.with_suffix(".md").write_text(_report(res))
    print(_report(res), flush=True)
    return 0


def _agreement(want: list[list[int]], got: list[list[int]]) -> str:
    """'equal / all' greedy tokens, position by position up to each row's first difference."""
    same = 0
    for w, g in zip(want, got):
        for a, b in zip(w, g):
            if a != b:
                break
            same += 1
    return f"{same} / {sum(map(len, want))}"


def _report(res: dict) -> str:
    names = list(res["decode"])
    base = names[0]
    lines = [f"# Switch '{res['switch']}' ({res['date']}, {res['device']}, "
             f"torch {res['torch']}, triton {res['triton']})", "",
             f"Llama-3-8B shape, random bf16 weights, 128-token prompts, 128 outputs, greedy; "
             f"copy bandwidth {res['copy_bandwidth_GBps']:.0f} GB/s in the process. "
             f"Greedy tokens equal to {base}'s up to the first difference: {res['tokens_equal']}.", "",
             "| batch | " + " | ".join(f"{n} tok/s (repeats)" for n in names) + " | "
             + " | ".join(f"{n} / {base}" for n in names[1:]) + " | step / roofline, "
             + " -> ".join(names) + " |",
             "| ---: |" + " --- |" * len(names) + " ---: |" * (len(names) - 1) + " --- |"]
    for b in res["decode"][base]:
        med = {}
        cells, roof = [], []
        for name in names:
            runs = res["decode"][name][b]
            med[name] = statistics.median(r["decode_tokens_per_s"] for r in runs)
            cells.append(f"{med[name]:.1f} {[round(r['decode_tokens_per_s'], 1) for r in runs]}")
            roof.append(f"{statistics.median(r['step_over_roofline'] for r in runs):.3f}")
        lines.append(f"| {b} | " + " | ".join(cells) + " | "
                     + " | ".join(f"{med[n] / med[base]:.3f}x" for n in names[1:]) + " | "
                     + " -> ".join(roof) + " |")
    if "throughput" in res:
        lines += ["", "| 1,000 ShareGPT-like requests | output tok/s (repeats) | % of the bound |",
                  "| --- | --- | --- |"]
        for name in names:
            runs = res["throughput"][name]
            lines.append(f"| {name} | {[round(r['output_tokens_per_s']) for r in runs]} | "
                         f"{[round(r['pct_of_bound'], 1) for r in runs]} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())

"""Weights into L2 on a side stream ahead of their matmul (kernels/l2_prefetch.py):
does it pay, and how much should a fork point ask for?

    python benchmarks/runtime/bench_l2_prefetch.py --out DIR [--stages micro,engine] [--smoke]

micro   Llama-3-8B's four weight shapes at 1 and 64 rows. A CUDA graph runs 16
        "layers", each a latency-bound kernel of T us (a spin on one program:
        attention's stand-in) followed by cuBLAS on its own copy of the weight
        (16 copies: L2 holds none of them when its turn comes). Variants: no
        prefetch; the weight asked for on a side stream forked when the spin
        starts (whole, the first half, one line in two). Reports us per layer.
engine  The engine (`LLM`, Llama-3-8B shape, random bf16 weights) decoding at
        batch 1 / 8 / 64 under several prefetch plans in one process, the plans
        alternated (off, plan, off, plan...): the decode graphs are captured
        again for each plan. Reports the decode step (bench latency's
        tokens/s and a graph replay timed alone) and the share of the copy
        bandwidth measured in the same process; checks that greedy tokens are
        the same under every plan.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}


def _spin_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def spin(out, ns):
        t0 = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                       is_pure=False, pack=1)
        t = t0
        while t - t0 < ns:
            t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [],
                                          dtype=tl.int64, is_pure=False, pack=1)
        tl.store(out, t - t0)
    return spin


def _graph_time(fn, reps: int = 20) -> float:
    """Seconds per replay of a graph capturing fn()."""
    import torch
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return statistics.median(ts)


def stage_micro(smoke: bool) -> dict:
    import torch
    from slipstream.kernels.l2_prefetch import prefetch_l2
    spin = _spin_kernel()
    dev = torch.device("cuda")
    side = torch.cuda.Stream(dev)
    clock = torch.zeros(1, dtype=torch.int64, device=dev)
    copies = 4 if smoke else 16
    rows = []
    variants = {"none": None, "whole": (None, 1, False), "whole_evict_last": (None, 1, True),
                "first_half": ("half", 1, False), "every_2nd_line": (None, 2, False)}
    for name, (n, k) in SHAPES.items():
        if smoke:
            n, k = n // 16, k // 16
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
        size = n * k * 2
        for m in (1, 64):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            for spin_us in (0, 3, 8):
                res = {"weight": name, "shape": [n, k], "rows": m, "spin_us": spin_us,
                       "weight_MB": size / 1e6}
                for vname, v in variants.items():
                    def layers():
                        main = torch.cuda.current_stream()
                        for w in ws:
                            if v is not None:
                                side.wait_stream(main)
                                with torch.cuda.stream(side):
                                    prefetch_l2(w, size // 2 if v[0] == "half" else None, v[1],
                                                v[2])
                            if spin_us:
                                spin[(1,)](clock, spin_us * 1000)
                            torch.nn.functional.linear(x, w)
                        if v is not None:
                            main.wait_stream(side)
                    res[vname + "_us"] = _graph_time(layers) / copies * 1e6
                if spin_us == 0:   # the matmul alone after a finished prefetch, and after a read
                    def fetched():
                        for w in ws:
                            prefetch_l2(w)
                            spin[(1,)](clock, 20_000)   # the prefetch has landed
                            torch.nn.functional.linear(x, w)
                    def read_first():
                        for w in ws:
                            spin[(1,)](clock, 20_000)
                            torch.nn.functional.linear(x, w)
                    res["after_prefetch_us"] = _graph_time(fetched) / copies * 1e6 - 20
                    res["after_spin_us"] = _graph_time(read_first) / copies * 1e6 - 20
                rows.append(res)
                print(json.dumps(res), flush=True)
        del ws
        torch.cuda.empty_cache()
    return {"rows": rows}


PLANS = {
    "off": None,
    "o": {"o_proj": None},
    "o+gate_up8": {"o_proj": None, "gate_up": 8},
    "o+qkv16": {"o_proj": None, "qkv": 16},
    "o+all_small": {"o_proj": None, "gate_up": 8, "down": 8, "qkv": 16},
}


def _replay_time(engine, batch: int) -> float | None:
    """Seconds per replay of the decode graph of `batch`'s bucket (timed alone)."""
    import torch
    graphs = engine.runner.graphs
    keys = [k for k in graphs.graphs if k[0] == graphs.bucket_for(batch)]
    if not keys:
        return None
    g = graphs.graphs[keys[0]][0]
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return statistics.median(ts)


def _tokens(llm) -> list[list[int]]:
    """Greedy tokens of four fixed prompts (the engine runs without a prefix
    cache: a cached prefix changes the prompt's kernels, hence near-tied
    greedy picks of random weights)."""
    from slipstream import SamplingParams
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 1000 + 1 for j in range(32)]}
               for i in range(4)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def stage_engine(smoke: bool, plans: list[str], rounds: int) -> dict:
    import torch
    from slipstream import LLM
    from slipstream.analysis.hardware import measure_copy_bandwidth
    from slipstream.bench import latency
    from slipstream.kernels import l2_prefetch
    llm = LLM("llama-3-8b", load_format="dummy", dtype="bfloat16", max_num_seqs=64,
              enable_prefix_caching=False)
    engine = llm.engine
    bw = measure_copy_bandwidth(torch.device("cuda"))
    batches = [1] if smoke else [1, 8, 64]
    rows, tokens = [], {}
    order = []
    for r in range(rounds):
        for p in plans:
            order += ["off", p] if p != "off" else []
    order = order or ["off"]
    for n, plan_name in enumerate(order):
        l2_prefetch.PLAN = PLANS[plan_name]
        engine.runner.graphs.graphs.clear()      # capture again under this plan
        torch.cuda.synchronize()
        toks = _tokens(llm)
        tokens.setdefault(plan_name, []).append(toks)
        for b in batches:
            args = SimpleNamespace(batch_size=b, input_len=128, output_len=128,
                                   num_iters_warmup=1, num_iters=3, dataset_seed=b)
            res = latency.run(engine, args, bw)
            replay = _replay_time(engine, b)
            row = {"plan": plan_name, "batch": b, "decode_tok_s": res["decode_tokens_per_s"],
                   "step_ms": res["decode_step_s"] * 1e3,
                   "pct_copy_bw": res["decode_pct_copy_bandwidth"],
                   "replay_ms": replay * 1e3 if replay else None,
                   "replay_pct_copy_bw": (100 * res["decode_step_bytes"] / replay / bw
                                          if replay and res["decode_step_bytes"] else None)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    same = {p: all(t == tokens["off"][0] for t in ts) for p, ts in tokens.items()}
    print("greedy tokens equal to plan off:", same, flush=True)
    return {"copy_bandwidth_GBps": bw / 1e9, "rows": rows, "tokens_equal": same,
            "plans": {p: PLANS[p] for p in tokens}}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--stages", default="micro,engine")
    ap.add_argument("--plans", default="o,o+all_small,o+qkv16")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    import torch
    import triton
    a.out.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "date": time.strftime("%Y-%m-%d")}
    try:
        meta["commit"] = (ROOT / "COMMIT").read_text().strip()
    except OSError:
        pass
    for stage in a.stages.split(","):
        t0 = time.perf_counter()
        if stage == "micro":
            res = stage_micro(a.smoke)
        elif stage == "engine":
            res = stage_engine(a.smoke, a.plans.split(","), a.rounds)
        else:
            raise SystemExit(f"unknown stage {stage!r}")
        res.update(meta, stage_seconds=time.perf_counter() - t0)
        (a.out / f"l2_prefetch_{stage}.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Batch 64 with speculation switched off and no probes (the rule "quiet"), on the CPU:
the host time of an engine step, plain against n-gram and EAGLE (a random EAGLE-3
head tapping three layers), and the time inside each of the speculator's per-step calls.

A tiny random Llama (load_format="dummy"), 64 greedy requests. Speculating engines
first run one prompt at batch 1 with the rule off (as `bench spec` warms up); n-gram
is then charged a drafting cost no round at batch 64 could pay back (its measured
one is small enough that probes may still run). The three engines hold 64 decoding
requests at once and their steps are timed in turn, order rotating, so that the load
of a shared machine falls on them alike; every timed step is checked quiet.

    python benchmarks/spec/cpu_batch64_overhead.py [--sync] [--steps 150] [--repeats 4]

--sync: no async scheduling (the CPU default); without it, steps overlap as on a GPU.
"""
import argparse
import json
import statistics
import tempfile
import time

import torch

from slipstream import LLM, SamplingParams
from slipstream.loader import open_model
from slipstream.spec.eagle_head import EagleHead, EagleShape

SPEC_CALLS = ("wants_overlap", "stage", "patch", "verify", "keep_hidden", "step_done", "propose")


def build(folder: str, layers: int, sync: bool):
    json.dump(dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=512,
                   hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                   rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                   bos_token_id=1, eos_token_id=2, torch_dtype="float32"),
              open(f"{folder}/config.json", "w"))
    c = open_model(folder, "dummy").config
    torch.manual_seed(0)
    head = f"{folder}/e3.safetensors"
    taps = ",".join(str(i) for i in (0, layers // 2, layers - 1))
    EagleHead(EagleShape(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                         64, c.rope_theta, c.max_position_embeddings, feature_layers=taps)).save(head)
    common = dict(load_format="dummy", device="cpu", dtype="float32", seed=0, num_kv_blocks=2048,
                  max_model_len=512, block_size=16, async_scheduling=not sync)
    engines = {"plain": LLM(folder, **common)}
    warm = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    one = [{"prompt_token_ids": torch.randint(3, 500, (12,), generator=g).tolist()}]
    for m in ("ngram", "eagle"):
        kw = dict(speculative_model=head) if m == "eagle" else {}
        engines[m] = LLM(folder, speculative_method=m, speculative_auto_off=False, **kw, **common)
        engines[m].generate(one, warm, use_tqdm=False)        # batch-1 rounds
        gov = engines[m].engine.runner.speculator.governor
        gov.auto_off = True
        if m == "ngram":
            for _ in range(50):
                gov.observe_draft(0.05)
    return engines


def timed(spent: dict, obj, attr: str) -> None:
    real = getattr(obj, attr)

    def call(*a, **k):
        t0 = time.perf_counter()
        try:
            return real(*a, **k)
        finally:
            entry = spent.setdefault(attr, [0.0, 0])
            entry[0] += time.perf_counter() - t0
            entry[1] += 1
    setattr(obj, attr, call)


def round_robin(engines: dict, prompts: list, steps: int) -> dict[str, list[float]]:
    params = SamplingParams(temperature=0.0, max_tokens=steps + 30, ignore_eos=True)
    es = {k: llm.engine for k, llm in engines.items()}
    for e in es.values():
        for p in prompts:
            e.add_request(p, params)
        for _ in range(12):          # the prompts, then decoding
            e.step()
        assert not e.scheduler.waiting
    rounds = {k: e.runner.speculator.stats.rounds for k, e in es.items() if e.runner.speculator}
    out = {k: [] for k in es}
    names = list(es)
    for i in range(steps):
        for k in names[i % 3:] + names[:i % 3]:
            e = es[k]
            t0 = time.perf_counter()
            e.step()
            out[k].append(time.perf_counter() - t0)
            spec = e.runner.speculator
            assert spec is None or spec.governor.quiet, f"{k}: not quiet at step {i}"
    for k, e in es.items():
        if e.runner.speculator:
            assert e.runner.speculator.stats.rounds == rounds[k], f"{k}: rounds ran"
        while e.has_unfinished_requests():
            e.step()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sync", action="store_true")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--layers", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        engines = build(folder, args.layers, args.sync)
        g = torch.Generator().manual_seed(0)
        prompts = [{"prompt_token_ids": torch.randint(3, 500, (int(n),), generator=g).tolist()}
                   for n in torch.randint(6, 14, (64,), generator=g)]
        spent = {}
        for name, llm in engines.items():
            spent[name] = {}
            timed(spent[name], llm.engine.runner.model, "forward")
            spec = llm.engine.runner.speculator
            for attr in SPEC_CALLS if spec is not None else ():
                timed(spent[name], spec, attr)
        times = {k: [] for k in engines}
        for _ in range(args.repeats):
            for k, v in round_robin(engines, prompts, args.steps).items():
                times[k] += v
    med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    fast = {k: statistics.mean(sorted(v)[:int(len(v) * 0.8)]) * 1e6 for k, v in times.items()}
    print(f"{'sync' if args.sync else 'async'} steps, {len(times['plain'])} per engine, all quiet")
    print("median us/step", {k: round(v) for k, v in med.items()},
          {k: round(v / med["plain"], 4) for k, v in med.items()})
    print("mean of the fastest 80% us/step", {k: round(v) for k, v in fast.items()},
          {k: round(v / fast["plain"], 4) for k, v in fast.items()})
    for name, d in spent.items():   # includes the timing wrapper's own ~0.3 us a call
        print(name, "us/call", {a: round(t / max(n, 1) * 1e6, 1) for a, (t, n) in d.items()})


if __name__ == "__main__":
    main()

"""The engine's step runtime on a GPU, against the ceilings and the previous
engine measured in the same run (Llama-3-8B shape, random bf16 weights).

    python benchmarks/runtime/bench_engine.py --out DIR [--stages latency,throughput,prefix,old]
        [--old PATH]   # a checkout of the previous engine's `slipstream/` parent folder

Each stage runs in its own process (a fresh GPU memory pool) and writes JSON:
  latency     decode at batch 1..128 (128-token prompts, 128 outputs, greedy):
              tokens/s, step time, the roofline step time (weight + KV bytes over
              the copy bandwidth measured in the same process), and the share of
              wall time the GPU is busy (profiler kernel time over wall time);
              batch 1 and 64 also with --enforce-eager
  throughput  1,000 ShareGPT-like requests (prompt 50-1,500, output 20-800 tokens,
              fixed seed) at once, with the analysis layer's roofline bound of the
              steps the scheduler ran
  old         the same 1,000 requests through the previous engine (`--old`), its
              model filled with random weights in place
  prefix      64 requests sharing a 2,000-token prompt against 64 distinct prompts
  profile     the kernels of a decode step at batch 1 and 64 (graphs on): name,
              launches per step, mean and total microseconds per step
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
MODEL = "llama-3-8b"
NUM_PROMPTS = 1000


def _llm(**kw):
    from slipstream import LLM
    if os.environ.get("BENCH_BLAS"):   # cublas | cublaslt: torch's preferred BLAS library
        import torch
        torch.backends.cuda.preferred_blas_library(os.environ["BENCH_BLAS"])
    opts = dict(load_format="dummy", dtype="bfloat16", max_num_seqs=256,
                enforce_eager=os.environ.get("BENCH_EAGER") == "1")
    if os.environ.get("BENCH_TOKEN_BUDGET"):   # max_num_batched_tokens (default: the engine's)
        opts["max_num_batched_tokens"] = int(os.environ["BENCH_TOKEN_BUDGET"])
    opts.update(kw)
    return LLM(MODEL, **opts)


def _busy_share(engine, batch: int) -> float:
    """GPU kernel time over wall time for decode steps of `batch` requests."""
    t = _kernel_table(engine, batch)
    return t["kernel_ms_per_step"] / t["wall_ms_per_step"]


def stage_latency(out: Path, eager: bool) -> dict:
    import torch
    from slipstream.analysis.hardware import measure_copy_bandwidth
    from slipstream.bench import latency
    llm = _llm(enforce_eager=eager or os.environ.get("BENCH_EAGER") == "1")
    bw = measure_copy_bandwidth(torch.device("cuda"))
    batches = [1, 64] if eager else [1, 8, 16, 32, 64, 128]
    if os.environ.get("BENCH_BATCHES"):   # e.g. "1,8,64"
        batches = [int(b) for b in os.environ["BENCH_BATCHES"].split(",")]
    rows = []
    for b in batches:
        args = SimpleNamespace(batch_size=b, input_len=128, output_len=128, num_iters_warmup=1,
                               num_iters=3, dataset_seed=b)
        r = latency.run(llm.engine, args, bw)
        r["roofline_step_s"] = r["decode_step_bytes"] / bw
        r["step_over_roofline"] = r["decode_step_s"] / r["roofline_step_s"]
        if b in (1, 64):
            r["gpu_busy_share"] = _busy_share(llm.engine, b)
        rows.append(r)
        print(latency.report(r), f"busy {r.get('gpu_busy_share')}", flush=True)
    return {"copy_bandwidth_GBps": bw / 1e9, "eager": eager, "rows": rows,
            "graphs": sorted(map(list, llm.engine.runner.graphs.graphs)) if llm.engine.runner.graphs else None,
            "kv": llm.engine.runner.plan.describe()}


def _requests(seed: int = 0):
    from slipstream.bench.dataset import sharegpt_like_requests
    return sharegpt_like_requests(NUM_PROMPTS, 128256, 8192, seed)


def _timed_steps(llm, reqs) -> dict:
    """The requests at once through the engine's step loop, each step timed."""
    from slipstream import SamplingParams
    engine = llm.engine
    engine.step_stats = []
    for r in reqs:
        engine.add_request({"prompt_token_ids": r.prompt_token_ids},
                           SamplingParams(max_tokens=r.output_len, temperature=0, ignore_eos=True))
    times, kinds = [], []
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        n = len(engine.step_stats)
        engine.step()
        times.append(time.perf_counter() - t)
        s = engine.step_stats[n] if len(engine.step_stats) > n else None
        kinds.append("none" if s is None else "decode" if s.num_decode_seqs == s.num_seqs else "mixed")
    elapsed = time.perf_counter() - t0
    engine.step_stats = None
    by = {k: sum(t for t, kk in zip(times, kinds) if kk == k) for k in ("decode", "mixed", "none")}
    slow = sorted(zip(times, kinds, range(len(times))), reverse=True)[:12]
    return {"elapsed_s": elapsed, "seconds_by_step_kind": by, "steps": len(times),
            "slowest_steps": [(round(t * 1e3, 1), k, i) for t, k, i in slow],
            "median_step_ms": {k: 1e3 * statistics.median([t for t, kk in zip(times, kinds) if kk == k] or [0])
                               for k in ("decode", "mixed")}}


class _GCPauses:
    """The collector's pauses while the block runs: count and seconds per
    generation, and the longest."""

    def __enter__(self):
        import gc
        self.count, self.seconds, self.longest_ms, self._t0 = [0, 0, 0], [0.0, 0.0, 0.0], 0.0, 0.0
        gc.callbacks.append(self._on)
        return self

    def _on(self, phase, info):
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        dt = time.perf_counter() - self._t0
        g = info["generation"]
        self.count[g] += 1
        self.seconds[g] += dt
        self.longest_ms = max(self.longest_ms, dt * 1e3)

    def __exit__(self, *exc):
        import gc
        gc.callbacks.remove(self._on)

    def report(self) -> dict:
        return {"count_by_generation": self.count,
                "seconds_by_generation": [round(x, 4) for x in self.seconds],
                "longest_ms": round(self.longest_ms, 2)}


def stage_throughput(out: Path) -> dict:
    import torch
    from slipstream.analysis.hardware import (HardwareProfile, measure_copy_bandwidth,
                                              measure_matmul_rate)
    from slipstream.bench import throughput
    llm = _llm()
    dev = torch.device("cuda")
    hw = HardwareProfile("H200", measure_copy_bandwidth(dev), measure_matmul_rate(dev, torch.bfloat16),
                         source="measured in this process")
    reqs = _requests()
    # A first pass of other prompts (no prefix-cache hits later): kernels compile,
    # graphs are captured.
    cold = _timed_steps(llm, _requests(seed=1))
    print("cold", cold, flush=True)
    args = SimpleNamespace(dataset="sharegpt-like", num_prompts=NUM_PROMPTS, dataset_seed=0,
                           input_len=None, output_len=None)
    with _GCPauses() as pauses:
        res = throughput.run(llm, args, hw)
    res["gc_pauses"] = pauses.report()
    res["gc_freeze"] = os.environ.get("SLIPSTREAM_GC_FREEZE", "1")
    print(throughput.report(res), "gc", res["gc_pauses"], flush=True)
    res["cold_pass"] = cold
    # The same kind of pass again, warm, each step timed: where the time goes.
    with _GCPauses() as pauses:
        res["warm_pass"] = _timed_steps(llm, _requests(seed=2))
    res["warm_pass"]["gc_pauses"] = pauses.report()
    print("warm", res["warm_pass"], flush=True)
    res["graphs_captured"] = len(llm.engine.runner.graphs.graphs)          # decode graphs
    pw = llm.engine.runner.piecewise
    res["piecewise_buckets_captured"] = None if pw is None else sorted(pw.pieces)
    res["max_num_batched_tokens"] = llm.engine.config.scheduler.max_num_batched_tokens
    (out / "requests.json").write_text(json.dumps([[r.prompt_token_ids, r.output_len] for r in reqs]))
    return res


def stage_prefix(out: Path) -> dict:
    import random
    from slipstream import SamplingParams
    llm = _llm()
    rng = random.Random(0)
    shared = [rng.randrange(1, 128000) for _ in range(2000)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    res = {}
    for name in ("distinct", "shared"):
        llm.generate([{"prompt_token_ids": [rng.randrange(1, 128000) for _ in range(2016)]}],
                     params, use_tqdm=False)   # warm-up
        prompts = []
        for i in range(64):
            head = shared if name == "shared" else [rng.randrange(1, 128000) for _ in range(2000)]
            prompts.append({"prompt_token_ids": head + [rng.randrange(1, 128000) for _ in range(16)]})
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        res[name] = {"seconds": time.perf_counter() - t0,
                     "cached_tokens": sum(o.num_cached_tokens for o in outs)}
    res["speedup"] = res["distinct"]["seconds"] / res["shared"]["seconds"]
    print(res, flush=True)
    return res


def stage_old(out: Path) -> dict:
    """The previous engine (imported from --old), its model filled in place."""
    import torch
    from slipstream import LLM, SamplingParams
    from slipstream.config import ModelConfig
    import slipstream.engine.engine as eng
    from slipstream.models.llama import LlamaForCausalLM

    hf = dict(architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096,
              intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
              num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
              rms_norm_eps=1e-5)

    class Tok:
        eos_token_ids = ()

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

        def encode(self, text, add_special_tokens=True):
            return [int(t) for t in text.split()]

    class Files:
        path = Path(MODEL)
        config = ModelConfig.from_hf_config(hf)

        def weights(self):
            return iter(())

        def tokenizer(self):
            return Tok()

    def fill(self, weights):
        g = torch.Generator(device="cuda").manual_seed(0)
        for name, p in self.named_parameters():
            if "norm" in name:
                p.data.fill_(1.0)
            else:
                p.data.uniform_(-0.035, 0.035, generator=g)

    eng.open_model = lambda model: Files()
    LlamaForCausalLM.load_weights = fill
    llm = LLM(MODEL, dtype="bfloat16", max_num_seqs=256)
    reqs = json.loads((out / "requests.json").read_text())
    prompts = [{"prompt_token_ids": p} for p, _ in reqs]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for _, n in reqs]
    llm.generate(prompts[:8], params[:8], use_tqdm=False)   # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    res = {"elapsed_s": elapsed, "output_tokens": n_out, "output_tokens_per_s": n_out / elapsed,
           "requests_per_s": len(reqs) / elapsed}
    print(res, flush=True)
    return res


def _kernel_table(engine, batch: int, steps: int = 20) -> dict:
    """Kernel launches and device time per decode step of `batch` requests."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from slipstream import SamplingParams
    params = SamplingParams(max_tokens=3 * steps, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request({"prompt_token_ids": [(7 * i + j) % 1000 + 1 for j in range(128)]}, params)
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    rows = []
    for e in prof.key_averages():
        if e.self_device_time_total <= 0:
            continue
        rows.append({"kernel": e.key[:120], "per_step": e.count / steps,
                     "mean_us": e.self_device_time_total / max(e.count, 1),
                     "us_per_step": e.self_device_time_total / steps})
    rows.sort(key=lambda r: -r["us_per_step"])
    while engine.has_unfinished_requests():
        engine.step()
    return {"batch": batch, "wall_ms_per_step": 1e3 * wall / steps,
            "kernel_ms_per_step": sum(r["us_per_step"] for r in rows) / 1e3,
            "launches_per_step": sum(r["per_step"] for r in rows), "kernels": rows}


def _mixed_table(engine, decodes: int = 128, prompt_len: int = 512, prompts: int = 2,
                 decode_prompt_len: int = 256, repeats: int = 10) -> dict:
    """Kernels and wall time of steps that prefill `prompts` new prompts of
    `prompt_len` tokens beside `decodes` running decodes (eager steps)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from slipstream import SamplingParams
    params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    for i in range(decodes):
        engine.add_request({"prompt_token_ids": [(7 * i + j) % 1000 + 1 for j in range(decode_prompt_len)]},
                           params)
    for _ in range(8):
        engine.step()
    short = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    walls, rows = [], {}
    for r in range(repeats):
        for p in range(prompts):
            engine.add_request({"prompt_token_ids": [(13 * r + 5 * p + j) % 30000 + 1
                                                     for j in range(prompt_len)]}, short)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            engine.step()
            engine.step()   # collects the mixed step (overlap: the next one is launched)
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - t0)
        for e in prof.key_averages():
            if e.self_device_time_total > 0:
                acc = rows.setdefault(e.key[:120], [0, 0.0])
                acc[0] += e.count
                acc[1] += e.self_device_time_total
    while engine.has_unfinished_requests():
        engine.step()
    table = sorted(({"kernel": k, "per_step": c / repeats, "us_per_step": t / repeats}
                    for k, (c, t) in rows.items()), key=lambda r: -r["us_per_step"])
    return {"decodes": decodes, "prompt_tokens": prompts * prompt_len,
            "wall_ms_two_steps": 1e3 * statistics.median(walls),
            "kernel_ms_two_steps": sum(r["us_per_step"] for r in table) / 1e3,
            "launches_two_steps": sum(r["per_step"] for r in table), "kernels": table}


def stage_profile(out: Path) -> dict:
    llm = _llm()
    res = {}
    m = res["mixed"] = _mixed_table(llm.engine)
    print(f"mixed ({m['decodes']} decodes + {m['prompt_tokens']} prompt tokens, then one decode step): "
          f"wall {m['wall_ms_two_steps']:.2f} ms, kernels {m['kernel_ms_two_steps']:.2f} ms, "
          f"{m['launches_two_steps']:.0f} launches", flush=True)
    for r in m["kernels"][:25]:
        print(f"  {r['us_per_step']:9.1f} us {r['per_step']:6.1f}x  {r['kernel']}", flush=True)
    for b in (1, 64):
        t = _kernel_table(llm.engine, b)
        res[f"batch{b}"] = t
        print(f"batch {b}: wall {t['wall_ms_per_step']:.3f} ms/step, kernels {t['kernel_ms_per_step']:.3f} ms, "
              f"{t['launches_per_step']:.0f} launches", flush=True)
        for r in t["kernels"][:25]:
            print(f"  {r['us_per_step']:9.1f} us {r['per_step']:6.1f}x {r['mean_us']:8.2f} us  {r['kernel']}",
                  flush=True)
    return res


STAGES = {"profile": stage_profile, "latency": lambda o: stage_latency(o, False), "latency_eager": lambda o: stage_latency(o, True),
          "throughput": stage_throughput, "prefix": stage_prefix, "old": stage_old}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--stages", default="latency,latency_eager,throughput,old,prefix")
    ap.add_argument("--old", type=Path, default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    if a.worker:
        t0 = time.perf_counter()
        res = STAGES[a.worker](a.out)
        res["stage_seconds"] = time.perf_counter() - t0
        (a.out / f"{a.worker}.json").write_text(json.dumps(res, indent=1, default=str))
        return 0
    import torch
    meta = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "commit": os.environ.get("COMMIT", "unknown"), "model": f"{MODEL} shape, random bf16 weights"}
    (a.out / "meta.json").write_text(json.dumps(meta, indent=1))
    for stage in a.stages.split(","):
        env = dict(os.environ)
        path = str(a.old) if stage == "old" else str(ROOT)
        env["PYTHONPATH"] = path + os.pathsep + env.get("PYTHONPATH", "")
        here = Path(__file__).resolve()
        print(f"== {stage}", flush=True)
        rc = subprocess.call([sys.executable, str(here), "--out", str(a.out), "--worker", stage],
                             env=env, cwd=path)
        print(f"== {stage}: exit {rc}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where the host time of an eager prompt step goes (cProfile), Llama-3-8B shape,
random bf16 weights.

    python benchmarks/runtime/host_profile.py --out DIR [--tokens 1024] [--steps 8]
    python benchmarks/runtime/host_profile.py --out /tmp/x --smoke     # CPU: path only
    python benchmarks/runtime/host_profile.py --out DIR --mixed 128 --tokens 512

--mixed N: steps that prefill two new `tokens`-token prompts beside N running
decodes (the throughput benchmark's slow steps), each followed by a decode step;
wall time per pair of steps with and without cProfile, engine.step as the unit.

Runs `steps` prompt steps of `tokens` tokens each (one prompt a step, max_tokens=1),
after a warm-up, under cProfile, and times the same steps without it: wall time
per step, and the GPU's kernel time per step from torch.profiler. A step whose
wall time is well above its kernel time is bound by the host; the cProfile table
(top functions by own time and by cumulative time) says where.
Writes DIR/host_profile.txt and DIR/host_profile.json.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
from pathlib import Path


def _steps(llm, prompts, sp):
    import torch
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for p in prompts:
        llm.generate([p], sp, use_tqdm=False)
    sync()
    return (time.perf_counter() - t0) / len(prompts)


def _measure(run, repeats: int, top: int = 40) -> tuple[float, float | None, float, str]:
    """run(n) -> seconds a unit over n units. Returns the wall seconds a unit, the GPU's
    kernel ms a unit (None on the CPU), the wall seconds under cProfile and its tables."""
    import torch
    wall = run(repeats)
    kernel_ms = None
    if torch.cuda.is_available():
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run(4)
        kernel_ms = sum(e.self_device_time_total for e in prof.key_averages()
                        if e.self_device_time_total > 0) / 1e3 / 4
    pr = cProfile.Profile()
    pr.enable()
    prof_wall = run(repeats)
    pr.disable()
    s = io.StringIO()
    st = pstats.Stats(pr, stream=s)
    st.sort_stats("tottime").print_stats(top)
    st.sort_stats("cumulative").print_stats(top)
    return wall, kernel_ms, prof_wall, s.getvalue()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--mixed", type=int, default=0, help="running decodes beside the prompts")
    a = ap.parse_args()
    if a.mixed:
        return mixed(a)
    import torch
    from slipstream import LLM, SamplingParams
    a.out.mkdir(parents=True, exist_ok=True)
    tokens = 32 if a.smoke else a.tokens
    llm = LLM(None if a.smoke else "llama-3-8b", load_format="auto" if a.smoke else "dummy",
              dtype="float32" if a.smoke else "bfloat16", max_num_batched_tokens=max(tokens, 2048),
              max_model_len=tokens + 16, seed=0)
    vocab = llm.engine.config.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(0, vocab, (tokens,), generator=g).tolist()}
               for _ in range(a.steps)]
    sp = SamplingParams(max_tokens=1, ignore_eos=True)
    _steps(llm, prompts[:2], sp)                                     # warm-up
    wall, kernel_ms, prof_wall, tables = _measure(
        lambda n: _steps(llm, prompts[:n], sp), a.steps)
    head = (f"{tokens}-token prompt steps: wall {wall * 1e3:.2f} ms a step, kernel "
            f"{kernel_ms if kernel_ms is None else round(kernel_ms, 2)} ms a step; under cProfile "
            f"{prof_wall * 1e3:.2f} ms")
    (a.out / "host_profile.txt").write_text(head + "\n\n" + tables)
    (a.out / "host_profile.json").write_text(json.dumps(
        {"tokens": tokens, "steps": a.steps, "wall_ms": wall * 1e3, "kernel_ms": kernel_ms,
         "cprofile_wall_ms": prof_wall * 1e3}, indent=1))
    print(head)
    print("\n".join(tables.splitlines()[:60]))
    return 0


def mixed(a) -> int:
    import torch
    from slipstream import LLM, SamplingParams
    a.out.mkdir(parents=True, exist_ok=True)
    llm = LLM(None if a.smoke else "llama-3-8b", load_format="auto" if a.smoke else "dummy",
              dtype="float32" if a.smoke else "bfloat16", max_num_seqs=256, seed=0)
    engine = llm.engine
    vocab = engine.config.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    rand = lambda n: {"prompt_token_ids": torch.randint(0, vocab, (n,), generator=g).tolist()}  # noqa: E731
    for _ in range(a.mixed):
        engine.add_request(rand(256), SamplingParams(max_tokens=10_000, ignore_eos=True))
    for _ in range(12):
        engine.step()
    one = SamplingParams(max_tokens=1, ignore_eos=True)

    def pairs(n):
        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            engine.add_request(rand(a.tokens), one)
            engine.add_request(rand(a.tokens), one)
            engine.step()
            engine.step()
        sync()
        return (time.perf_counter() - t0) / n
    pairs(4)                                                     # captures, compiles
    wall, kernel_ms, prof_wall, tables = _measure(pairs, a.steps, top=50)
    head = (f"{a.mixed} decodes + 2 x {a.tokens}-token prompts, then a decode step: wall "
            f"{wall * 1e3:.2f} ms a pair of steps, GPU kernels {kernel_ms} ms; under cProfile "
            f"{prof_wall * 1e3:.2f} ms")
    (a.out / "host_profile_mixed.txt").write_text(head + "\n\n" + tables)
    (a.out / "host_profile_mixed.json").write_text(json.dumps(
        {"decodes": a.mixed, "tokens": a.tokens, "pairs": a.steps, "wall_ms": wall * 1e3,
         "kernel_ms": kernel_ms,
         "cprofile_wall_ms": prof_wall * 1e3}, indent=1))
    print(head)
    for i in range(10):
        engine.step()
    for rid in list(engine.scheduler.requests):
        engine.abort_request(rid)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

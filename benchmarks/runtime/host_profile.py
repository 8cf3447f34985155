"""Where the host time of an eager prompt step goes (cProfile), Llama-3-8B shape,
random bf16 weights.

    python benchmarks/runtime/host_profile.py --out DIR [--tokens 1024] [--steps 8]
    python benchmarks/runtime/host_profile.py --out /tmp/x --smoke     # CPU: path only

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


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
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
    wall = _steps(llm, prompts, sp)
    kernel_ms = None
    if torch.cuda.is_available():
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            _steps(llm, prompts[:4], sp)
        kernel_us = sum(e.self_device_time_total for e in prof.key_averages() if e.self_device_time_total > 0)
        kernel_ms = kernel_us / 1e3 / 4
    pr = cProfile.Profile()
    pr.enable()
    prof_wall = _steps(llm, prompts, sp)
    pr.disable()
    s = io.StringIO()
    st = pstats.Stats(pr, stream=s)
    st.sort_stats("tottime").print_stats(40)
    st.sort_stats("cumulative").print_stats(40)
    head = (f"{tokens}-token prompt steps: wall {wall * 1e3:.2f} ms a step, kernel "
            f"{kernel_ms if kernel_ms is None else round(kernel_ms, 2)} ms a step; under cProfile "
            f"{prof_wall * 1e3:.2f} ms")
    (a.out / "host_profile.txt").write_text(head + "\n\n" + s.getvalue())
    (a.out / "host_profile.json").write_text(json.dumps(
        {"tokens": tokens, "steps": a.steps, "wall_ms": wall * 1e3, "kernel_ms": kernel_ms,
         "cprofile_wall_ms": prof_wall * 1e3}, indent=1))
    print(head)
    print("\n".join(s.getvalue().splitlines()[:60]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""W8A8 prefill: does int8 / fp8 W8A8 reach 1.5x bf16 prefill throughput, and where does
the time go? One run answers both (H200, about 3-4 minutes):

1. kernels (w8a8_kernel_checks.py), correctness first: every W8A8 GEMM candidate at
   M=2048 over Llama-3-8B's four linear shapes against its twin, then timed (CUDA graph
   replay, median); the quantizing producers (add+RMSNorm, SiLU * up) fused vs unfused.
2. end to end, each variant in a fresh process:
       LLM("llama-3-8b", load_format="dummy", quantization=SCHEME, dtype="bfloat16",
           enforce_eager=True, max_num_seqs=1, enable_prefix_caching=False)
   (--graphs: enforce_eager=False, so the prompt step runs as captured pieces around
   attention, runner/piecewise.py)
   one 2048-token prompt of fresh random ids to its first token, median of --iters; then
   one more prefill under torch.profiler: GPU kernel time by kernel, summed, against the
   wall time (the gap is host time the GPU waits for).
   Variants (environment of the child process):
       bf16
       w8a8-old   int8, producers unfused (SLIPSTREAM_W8A8_FUSE=0)
       w8a8-wide  int8, quantization fused into the norm / SiLU kernels, wide tiles
       w8a8       the same with the base tile set (the default)
       fp8-old    fp8 (_scaled_mm), producers unfused (SLIPSTREAM_FP8_GEMM=scaled_mm)
       fp8-scaled_mm  fp8 (_scaled_mm), fused producers
       fp8        fp8, fused producers, tuning picks _scaled_mm or the Triton kernel per
                  shape (the default)

    python benchmarks/quant/bench_w8a8_prefill.py [--out DIR] [--parts kernels,e2e]
        [--variants bf16,w8a8,...]                                   # H200
    PYTHONPATH=. python benchmarks/quant/bench_w8a8_prefill.py --smoke --out /tmp/w   # CPU
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.quant.child_runs import bench_model, run_child  # noqa: E402
from benchmarks.quant.child_runs import child_env as _env  # noqa: E402
VARIANTS = {
    "bf16": (None, {}),
    "w8a8-old": ("w8a8", {"SLIPSTREAM_W8A8_FUSE": "0"}),
    "w8a8-wide": ("w8a8", {"SLIPSTREAM_W8A8_TILES": "wide"}),
    "w8a8": ("w8a8", {}),
    "fp8-old": ("fp8", {"SLIPSTREAM_W8A8_FUSE": "0", "SLIPSTREAM_FP8_GEMM": "scaled_mm"}),
    "fp8-scaled_mm": ("fp8", {"SLIPSTREAM_FP8_GEMM": "scaled_mm"}),
    "fp8": ("fp8", {}),
}
TINY_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512,
               "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2,
               "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
               "torch_dtype": "float32"}


def _timer(device: str):
    if device != "cuda":
        def cpu_ms(fn):
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        return cpu_ms
    from benchmarks.cuda_timing import graph_timer
    return lambda fn: graph_timer([fn], min_calls=20, replays=5)()


def kernels(smoke: bool) -> dict:
    import torch

    from benchmarks.quant import w8a8_kernel_checks as K
    device = "cpu" if smoke else "cuda"
    m = 40 if smoke else 2048
    timer = _timer(device)
    t0 = time.perf_counter()
    g = K.gemm_rows(m, device, timer, smoke)
    p = K.producer_rows(m, device, timer, smoke)
    h = K.host_rows(m, device)
    return {"m": m, "gemm": g, "producers": p, "host": h, "seconds": time.perf_counter() - t0,
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "torch": torch.__version__}


def _run(engine, prompt, params) -> float:
    engine.add_request({"prompt_token_ids": prompt}, params)
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - t0


def one_variant(name: str, smoke: bool, iters: int, model: str) -> dict:
    import torch

    from slipstream import LLM, SamplingParams
    scheme = VARIANTS[name][0]
    device = "cpu" if smoke else "cuda"
    n = 64 if smoke else 2048
    t0 = time.perf_counter()
    llm = LLM(model, load_format="dummy", quantization=scheme, device=device,
              dtype="float32" if smoke else "bfloat16", max_num_seqs=1, max_model_len=n + 64,
              max_num_batched_tokens=n, enable_prefix_caching=False,
              enforce_eager=os.environ.get("BENCH_GRAPHS") != "1",
              gpu_memory_utilization=0.85)
    engine = llm.engine
    startup = time.perf_counter() - t0
    vocab = engine.config.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    rand = lambda: torch.randint(0, vocab, (n,), generator=g).tolist()  # noqa: E731
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    _run(engine, rand(), first)                                     # warm-up
    times = [_run(engine, rand(), first) for _ in range(iters)]
    res = {"variant": name, "scheme": scheme or "bf16", "startup_s": startup,
           "graphs": os.environ.get("BENCH_GRAPHS") == "1",
           "prefill_tokens": n, "prefill_ms": statistics.median(times) * 1e3,
           "prefill_ms_all": [t * 1e3 for t in times]}
    res["prefill_tokens_per_s"] = n / (res["prefill_ms"] / 1e3)
    if device == "cuda":
        res["profile"] = _profile(lambda: _run(engine, rand(), first))
    from slipstream.kernels import quant_tuning
    res["tuned"] = {str(k): v for k, v in quant_tuning.tuned_configs().items() if k[0] == "w8a8"}
    res["fused_producers"] = sum(getattr(mod, "quant", None) is not None
                                 for mod in engine.runner.model.modules())
    return res


def _profile(fn, top: int = 14) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    kern = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t and getattr(e, "device_type", None) is not None and \
                str(e.device_type).endswith("CUDA"):
            kern[e.key] = (kern.get(e.key, (0, 0))[0] + t, e.count)
    total = sum(t for t, _ in kern.values())
    rows = sorted(kern.items(), key=lambda kv: -kv[1][0])[:top]
    res = {"wall_ms": wall * 1e3, "gpu_kernel_ms": total / 1e3,
           "top": [{"kernel": k[:90], "ms": t / 1e3, "calls": c} for k, (t, c) in rows]}
    if not rows:      # the profiler's own table, should the kernel rows not be found
        try:
            res["table"] = prof.key_averages().table(sort_by="device_time_total", row_limit=top)
        except Exception as e:
            res["table"] = repr(e)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes / model on the CPU")
    ap.add_argument("--parts", default="kernels,e2e")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--iters", type=int, default=4)
    ap.add_argument("--graphs", action="store_true",
                    help="CUDA graphs on (prompt steps in pieces around attention); default eager")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.graphs:   # read by the child processes
        os.environ["BENCH_GRAPHS"] = "1"
    if args.one:
        res = kernels(args.smoke) if args.one == "kernels" else \
            one_variant(args.one, args.smoke, args.iters, args.model)
        Path(args.json).write_text(json.dumps(res, default=str))
        return 0
    for v in args.variants.split(","):
        if v not in VARIANTS:
            raise ValueError(f"--variants: unknown {v!r}; choose from {list(VARIANTS)}")
    parts = args.parts.split(",")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {}
    if "kernels" in parts:        # a child process: a crash there still leaves part 2
        path = Path(tempfile.mkdtemp()) / "kernels.json"
        rc = subprocess.run([sys.executable, __file__, "--one", "kernels", "--json", str(path)]
                            + (["--smoke"] if args.smoke else []), env=_env({})).returncode
        if rc == 0 and path.is_file():
            result["kernels"] = json.loads(path.read_text())
            print(f"kernels: {result['kernels']['seconds']:.0f} s", flush=True)
        else:
            result["kernels_failed"] = f"exit {rc}: see the console log"
    if "e2e" in parts:
        result["e2e"] = e2e(args)
    stem = "w8a8_prefill_smoke" if args.smoke else "w8a8_prefill"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1, default=str))
    from benchmarks.quant.w8a8_report import markdown
    md = markdown(result)
    (out / f"{stem}.md").write_text(md)
    print(md)
    bad = [r for r in result.get("kernels", {}).get("producers", []) if not r["ok"]]
    bad += ["kernels"] if "kernels_failed" in result else []
    bad += [r for r in result.get("e2e", []) if r.get("failed")]
    return 1 if bad else 0


def e2e(args) -> list[dict]:
    tmp = Path(tempfile.mkdtemp())
    model = bench_model(tmp, args.smoke, TINY_CONFIG)
    rows = []
    for name in args.variants.split(","):
        r = {"variant": name, **run_child(__file__, name, model, args.iters, args.smoke, tmp,
                                          _env(VARIANTS[name][1]))}
        rows.append(r)
        if not r.get("failed"):
            print(f"{name:10s} prefill {r['prefill_tokens']} tokens {r['prefill_ms']:8.2f} ms "
                  f"{r['prefill_tokens_per_s']:9.0f} tok/s (process {r['wall_s']:.0f} s)",
                  flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(main())

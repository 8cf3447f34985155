"""Tensor parallelism on two GPUs: correctness first, then decode latency and
the all-reduce cost, against the copy bandwidth measured in the same run.

    python benchmarks/tp/bench_tp.py [--out DIR] [--smoke]

(NCCL_NVLS_ENABLE=0 is set for every stage. Each stage has a time limit, the
whole run at most TOTAL_LIMIT_S, about 6 minutes on 2x H200.)

Stages, each in its own process (a fresh GPU memory pool and process group):
  allreduce   2 ranks, NCCL: all-reduce of a decode step's [1, hidden] bf16
              activations (8 KiB for hidden 4096, 16 KiB for 8192) and of 64 MiB,
              eager and replayed from a CUDA graph; median of many calls; with
              SLIPSTREAM_SYMM_ALL_REDUCE=1 the small ones also through the
              symmetric-memory one-shot all-reduce; and a decode row's sum + cast +
              residual add + RMSNorm: NCCL + the norm kernel against the fused kernel
              (distributed/all_reduce_norm.py)
  8b-tp1      Llama-3-8B shape, random bf16 weights (seed 0), TP=1
  8b-tp2      the same weights at TP=2: every rank keeps its slice of the tensors
              one process draws, so greedy tokens must equal TP=1's
  8b-tp2-symm the same with small all-reduces through the symmetric-memory
              one-shot kernel (SLIPSTREAM_SYMM_ALL_REDUCE=1)
  8b-tp2-fused, 70b-tp2-fused, 8b-tp2-fused-flags
              TP=2 with each row-parallel sum fused into the next RMSNorm
              (SLIPSTREAM_FUSED_ALL_REDUCE_NORM=lamport, the engine's default, or
              =flags; every other stage sets =0, NCCL): same tokens as 8b-tp2 expected
  70b-tp2     a 70B-class shape (llama-2-70b: 80 layers, hidden 8192, GQA 64/8), TP=2
  8b-tp1-fp32, 8b-tp2-fp32
              greedy tokens only, in float32: the TP=2 == TP=1 check without bf16's
              rounding (with random weights the top logits are near ties, and bf16
              runs of different kernel shapes part after a few tokens); the full
              8B shape (32 layers), with PyTorch attention and no CUDA graphs (the
              Triton attention kernels' float32 tuning compiled past the limit)
  8b-tp1-prof, 8b-tp2-prof, 8b-tp2-symm-prof (only when named in --stages)
              batch-1 decode under torch.profiler on every rank: 20 steps for
              kernel tables, 4 more for Chrome traces; writes
              {stage}_rank{r}_kernels.{json,md} and {stage}-trace_rank{r}_trace.json
              under --out, and the unprofiled wall time per step
An engine stage generates greedy tokens for 4 fixed prompts (the correctness
check), then times batch-1 decode (128-token prompt, 160 outputs, median step
time after 32 warm-up steps) and reports it as a share of the copy bandwidth:
weight bytes held per GPU / step time / copy bandwidth of that GPU.

--smoke runs the same stages on the CPU (gloo) with a tiny model, to check the
script; its times mean nothing. Writes results.json and results.md to --out
(default benchmarks/tp/results).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.stages import StageRunner  # noqa: E402
from benchmarks.tp.collectives import stage_allreduce  # noqa: E402
from benchmarks.tp.report import compare, markdown, pack_profiles  # noqa: E402
STAGES = ("allreduce", "8b-tp1", "8b-tp2", "70b-tp2", "8b-tp2-symm", "8b-tp1-fp32", "8b-tp2-fp32",
          "8b-tp2-fused", "70b-tp2-fused", "8b-tp2-fused-flags",
          "8b-tp1-prof", "8b-tp2-prof", "8b-tp2-symm-prof", "8b-tp2-fused-prof",
          "8b-tp2-fused-flags-prof")
MODELS = {"8b": "llama-3-8b", "70b": "llama-2-70b"}
PROMPTS = [[(31 * i + 7 * j) % 1000 + 1 for j in range(24 + 8 * i)] for i in range(4)]


def _tiny_model() -> str:
    """A small Llama config.json (random weights come from load_format=dummy)."""
    folder = Path(tempfile.mkdtemp(prefix="tp-smoke-"))
    (folder / "config.json").write_text(json.dumps(dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=1024, hidden_size=128,
        intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0)))
    return str(folder)


def _progress(msg: str) -> None:
    """A stage's milestones on stderr: a stage cut off at its limit shows how far it got."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def stage_engine(name: str, smoke: bool) -> dict:
    import torch
    from slipstream import LLM, SamplingParams
    from slipstream.analysis.hardware import measure_copy_bandwidth
    size, tp, *flags = name.split("-")   # e.g. 8b-tp2-symm-prof
    tp = tp.removeprefix("tp")
    fp32 = "fp32" in flags   # the correctness check without bf16 rounding
    if "symm" in flags:
        os.environ["SLIPSTREAM_SYMM_ALL_REDUCE"] = "1"
    # Row-parallel sums fused into the next RMSNorm (the engine's default, lamport) only
    # in the -fused stages: the others measure NCCL + the norm kernel.
    os.environ["SLIPSTREAM_FUSED_ALL_REDUCE_NORM"] = "0" if "fused" not in flags else (
        "reference" if smoke else "flags" if "flags" in flags else "lamport")
    model = _tiny_model() if smoke else MODELS[size]
    # A stage cut off at its limit prints every rank's Python stack a little before.
    import faulthandler
    dump_s = STAGE_LIMIT_S[name] - 10
    os.environ["SLIPSTREAM_HANG_DUMP_S"] = str(dump_s)
    faulthandler.dump_traceback_later(dump_s, exit=False)
    opts = dict(load_format="dummy", seed=0, tensor_parallel_size=int(tp), max_num_seqs=8,
                max_model_len=512)
    if "eager" in flags:
        opts.update(enforce_eager=True)
    if smoke:
        opts.update(device="cpu", dtype="float32")
    else:
        opts.update(dtype="float32" if fp32 else "bfloat16", gpu_memory_utilization=0.85)
    if fp32 and not smoke:
        # The Triton attention kernels' float32 tuning candidates compiled for over 80 s
        # (run 3: still in the prefill kernel's autotuner at the limit); the check needs
        # the model's arithmetic, not those kernels: PyTorch attention, no graphs.
        opts.update(attention_backend="torch", enforce_eager=True)
    t0 = time.perf_counter()
    _progress(f"{name}: starting the engine")
    llm = LLM(model, **opts)
    load_s = time.perf_counter() - t0
    _progress(f"{name}: engine up in {load_s:.1f} s")
    engine = llm.engine
    if "prof" in flags:
        result = _profile_decode(name, engine, smoke)
        engine.shutdown()
        return {"model": model if not smoke else "tiny", "tp": int(tp), "load_s": load_s, **result}
    greedy = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                for o in outs]
    _progress(f"{name}: greedy tokens done")
    if fp32:   # correctness only
        engine.shutdown()
        return {"model": model, "tp": int(tp), "dtype": "float32", "load_s": load_s,
                "tokens": tokens, "logprobs": logprobs}
    # Batch-1 decode latency.
    engine.add_request({"prompt_token_ids": [(5 * j) % 1000 + 1 for j in range(128)]},
                       SamplingParams(max_tokens=160, temperature=0, ignore_eos=True))
    for _ in range(32):
        engine.step()
    # Wall time over many steps: with the overlapped step a single step() returns
    # before its GPU work ends, so a per-step time would be host time only.
    steps, waited = 0, [0.0]
    plain_resolve = engine.runner.resolve

    def timed_resolve(handle):   # rank 0's host waiting for its GPU (~0: host-bound)
        t = time.perf_counter()
        out = plain_resolve(handle)
        waited[0] += time.perf_counter() - t
        return out
    engine.runner.resolve = timed_resolve
    if not smoke:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    if not smoke:
        torch.cuda.synchronize()
    step = (time.perf_counter() - t0) / steps
    del engine.runner.resolve
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
    copy_bw = measure_copy_bandwidth("cpu" if smoke else "cuda:0")
    engine.shutdown()
    if smoke:
        import shutil
        shutil.rmtree(model, ignore_errors=True)
    return {"model": model if not smoke else "tiny", "tp": int(tp), "load_s": load_s,
            "tokens": tokens, "logprobs": logprobs, "decode_step_ms": step * 1e3,
            "tokens_per_s": 1 / step, "host_wait_ms_per_step": waited[0] / steps * 1e3,
            "weight_bytes_per_gpu": weight_bytes,
            "copy_bandwidth_GBps": copy_bw / 1e9,
            "share_of_copy_bandwidth": weight_bytes / step / copy_bw}


def _profile_decode(name: str, engine, smoke: bool) -> dict:
    """Batch-1 decode under torch.profiler on every rank: a 20-step window for the
    kernel tables, then a 4-step one (host activity too) for the Chrome traces.
    Every rank writes {name}_rank{r}_kernels.{json,md} (and _trace.json) under --out."""
    import torch
    from slipstream import SamplingParams
    from slipstream.distributed.rank_profile import ProfileCommand, RankProfiler
    out = os.environ.get("TP_BENCH_OUT") or str(Path(__file__).parent / "results")
    runner = engine.runner
    local = None if hasattr(runner, "profile") else RankProfiler(0, runner.config.device)

    if local is not None:   # TP=1: time rank 0's waits for the GPU as the executor does
        from types import SimpleNamespace
        plain = SimpleNamespace(resolve=runner.resolve)
        runner.resolve = lambda handle: local.resolve(plain, handle)

    def window(steps: int, tag: str, trace: bool) -> dict:
        start = ProfileCommand("start", cpu=trace)
        stop = ProfileCommand("stop", out_dir=out, tag=tag, steps=steps, trace=trace)
        (runner.profile if local is None else local.start)(start)
        for _ in range(steps):
            engine.step()
        return (runner.profile if local is None else local.stop)(stop)

    def sync():
        if not smoke:
            torch.cuda.synchronize()

    engine.add_request({"prompt_token_ids": [(5 * j) % 1000 + 1 for j in range(128)]},
                       SamplingParams(max_tokens=120, temperature=0, ignore_eos=True))
    for _ in range(24):   # prefill, graph warm-up
        engine.step()
    sync()
    t0 = time.perf_counter()
    for _ in range(20):
        engine.step()
    sync()
    plain_ms = (time.perf_counter() - t0) / 20 * 1e3
    _progress(f"{name}: {plain_ms:.3f} ms a step unprofiled; profiling")
    table = window(20, name, trace=False)
    trace = window(4, name + "-trace", trace=True)
    while engine.has_unfinished_requests():
        engine.step()
    _progress(f"{name}: profiled")
    keep = ("wall_ms_per_step", "resolve_wait_ms_per_step", "kernel_ms_per_step",
            "busy_ms_per_step", "collective_ms_per_step", "launches_per_step")
    return {"decode_step_ms_unprofiled": plain_ms,
            "rank0": {k: table[k] for k in keep} | {"top": table["kernels"][:15]},
            "rank0_trace_window": {k: trace[k] for k in keep}, "files": out}


# ---- driver -----------------------------------------------------------------

# Seconds each stage may take at most, and the whole run (a stuck stage is cut off and
# reported, the others still run, and the results are written).
STAGE_LIMIT_S = {"allreduce": 60, "8b-tp1": 90, "8b-tp2": 120, "8b-tp2-symm": 100,
                 "8b-tp2-eager": 100, "70b-tp2": 150, "8b-tp1-fp32": 150, "8b-tp2-fp32": 150,
                 "8b-tp1-prof": 100, "8b-tp2-prof": 120, "8b-tp2-symm-prof": 120,
                 "8b-tp2-fused": 120, "70b-tp2-fused": 150, "8b-tp2-fused-prof": 90,
                 "8b-tp2-fused-flags": 120, "8b-tp2-fused-flags-prof": 90}
TOTAL_LIMIT_S = 540
_STAGES = StageRunner(__file__, STAGE_LIMIT_S, TOTAL_LIMIT_S)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--smoke", action="store_true", help="CPU, gloo, a tiny model")
    ap.add_argument("--stage", choices=STAGES + ("8b-tp2-eager",), help=argparse.SUPPRESS)
    ap.add_argument("--stages", default=",".join(STAGES[:9]),
                    help="comma-separated subset to run (the -prof stages only when named)")
    ap.add_argument("--budget-s", type=float, default=TOTAL_LIMIT_S,
                    help="seconds the whole run may take; later stages are skipped past it")
    args = ap.parse_args()
    _STAGES.total = args.budget_s
    if args.stage:
        fn = stage_allreduce if args.stage == "allreduce" else \
            (lambda smoke: stage_engine(args.stage, smoke))
        print(json.dumps(fn(args.smoke)))
        return
    res = {"smoke": args.smoke, "stages": {}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ["TP_BENCH_OUT"] = str(out.resolve())   # where the -prof stages' ranks write
    for stage in args.stages.split(","):
        print(f"running {stage} ...", file=sys.stderr, flush=True)
        res["stages"][stage] = _STAGES.run(stage, args.smoke)
        if "error" in res["stages"][stage]:
            print(res["stages"][stage]["error"], file=sys.stderr)
        if stage == "8b-tp2" and "error" in res["stages"][stage]:   # isolate CUDA graphs
            print("running 8b-tp2-eager ...", file=sys.stderr, flush=True)
            res["stages"]["8b-tp2-eager"] = _STAGES.run("8b-tp2-eager", args.smoke)
        # Written after every stage: a run killed from outside keeps the stages it finished.
        (out / "results.json").write_text(json.dumps(res, indent=2) + "\n")
    a, b = res["stages"].get("8b-tp1", {}), res["stages"].get("8b-tp2", {})
    if a and b and "error" not in a and "error" not in b:
        res["correctness_8b"] = compare(a, b)
        res["speedup_8b_tp2"] = a["decode_step_ms"] / b["decode_step_ms"]
    f1, f2 = res["stages"].get("8b-tp1-fp32", {}), res["stages"].get("8b-tp2-fp32", {})
    if f1 and f2 and "error" not in f1 and "error" not in f2:
        res["correctness_8b_fp32"] = compare(f1, f2)
    for name in ("8b-tp2-fused", "8b-tp2-fused-flags"):
        c = res["stages"].get(name, {})
        if b and "error" not in b and c and "error" not in c:
            # the same sums and roundings as NCCL + the norm kernel: the same tokens expected
            res.setdefault("fused_vs_nccl", {})[name] = compare(b, c) | {
                "speedup": b["decode_step_ms"] / c["decode_step_ms"],
                "over_tp1": a["decode_step_ms"] / c["decode_step_ms"]
                if a and "error" not in a else None}
    a70, c70 = res["stages"].get("70b-tp2", {}), res["stages"].get("70b-tp2-fused", {})
    if a70 and c70 and "error" not in a70 and "error" not in c70:
        res["fused_speedup_70b_tp2"] = a70["decode_step_ms"] / c70["decode_step_ms"]
    c = res["stages"].get("8b-tp2-symm", {})
    if a and "error" not in a and c and "error" not in c:
        res["speedup_8b_tp2_symm"] = a["decode_step_ms"] / c["decode_step_ms"]
    (out / "results.json").write_text(json.dumps(res, indent=2) + "\n")
    (out / "results.md").write_text(markdown(res, STAGES))
    pack_profiles(out)
    print(markdown(res, STAGES))


if __name__ == "__main__":
    main()

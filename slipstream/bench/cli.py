"""`slipstream bench latency | throughput | serve`: the argument parsers and the runs.

Flags follow vLLM's benchmark scripts: `--model`, `--load-format`,
`--batch-size`, `--input-len`, `--output-len`, `--num-prompts`,
`--dataset-seed`, `--output-json`, plus the engine options of `EngineArgs`
as `--option-name` (booleans as `--x/--no-x`). Without `--model` the default
model runs. torch is imported only when a benchmark runs, so the options are
listed here rather than read from EngineArgs (which imports torch); a test
checks that the list covers every field.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import fields
from pathlib import Path

# Set by the benchmark's own flags.
_NOT_FLAGS = {"model", "load_format"}
# EngineArgs field -> (type, default, help); bool fields become --x/--no-x.
ENGINE_OPTIONS = {
    "dtype": (str, "auto", "auto, bfloat16, float16 or float32"),
    "device": (str, "auto", "auto, cpu or cuda[:N]"),
    "max_model_len": (int, None, "context limit (default: the model's)"),
    "block_size": (int, 16, "tokens per KV block"),
    "max_num_seqs": (int, 256, "requests running at once"),
    "max_num_batched_tokens": (int, None, "token budget per step (default 2048)"),
    "enable_prefix_caching": (bool, True, "reuse KV blocks of shared prompt prefixes"),
    "enable_chunked_prefill": (bool, True, "split long prompts across steps"),
    "num_kv_blocks": (int, None, "fixed KV pool size"),
    "kv_cache_memory": (int, None, "bytes for the KV pool on the CPU"),
    "gpu_memory_utilization": (float, 0.90, "share of GPU memory the engine may use"),
    "kv_cache_dtype": (str, "auto", "KV cache: auto (model dtype), int8 or fp8 (1 byte + scales), kivi4 or kivi2"),
    "attention_backend": (str, None, "torch or triton (default: triton on CUDA)"),
    "quantization": (str, "auto", "auto, none, or a scheme (auto: GGUF blocks on the CPU, else none)"),
    "enforce_eager": (bool, False, "run decode steps eagerly (no CUDA graphs)"),
    "async_scheduling": (bool, None, "overlap host work with the device (default: on for CUDA)"),
    "seed": (int, 0, "seed of unseeded sampling and of dummy weights"),
    "tensor_parallel_size": (int, 1, "processes sharing each layer (GPUs on CUDA)"),
    "speculative_method": (str, None, "draft, ngram, medusa, eagle or peagle (speculative decoding)"),
    "speculative_model": (str, None, "draft model folder or Medusa / EAGLE head file"),
    "num_speculative_tokens": (int, None, "draft length (EAGLE: tree depth)"),
    "speculative_draft_layers": (int, None, "draft with the first N layers of the model"),
    "speculative_tree": (str, None, "medusa top-k per head '3,2,1'; eagle 'topk,beam,nodes'"),
    "speculative_auto_off": (bool, True, "stop drafting where the roofline predicts no gain"),
    "speculative_draft_graphs": (bool, False, "EAGLE: tree expansion from a CUDA graph (GPU)"),
    "speculative_device_loop": (bool, False, "EAGLE: one greedy prompt with every round on the device"),
    "speculative_compile": (bool, False, "EAGLE device loop: compile the expansion (torch.compile)"),
    "speculative_online": (bool, False, "EAGLE / P-EAGLE: keep training the head while serving"),
    "speculative_draft_min_prob": (float, 0.0, "EAGLE: drafts below this path probability not "
                                               "verified (0: off)"),
}


class _Defaults(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" where the help does not already say it and X is not None."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default is None or "default" in text:
            return text
        return super()._get_help_string(action)


def add_parsers(bench_subparsers) -> None:
    from slipstream.bench import latency, throughput
    for name, module, help_ in (
            ("latency", latency, "time prefill and decode of one batch of random prompts"),
            ("throughput", throughput, "requests/s and tokens/s of many requests at once")):
        p = bench_subparsers.add_parser(name, help=help_, description=module.__doc__.split("\n\n")[0],
                                        formatter_class=_Defaults)
        module.add_arguments(p)
        _common_arguments(p)
        p.set_defaults(func=run_latency if name == "latency" else run_throughput)
    from slipstream.bench import serve   # a client of a running server (standard library only)
    serve.add_parser(bench_subparsers)
    from slipstream.spec.cli import add_bench_parser
    add_bench_parser(bench_subparsers)


def _common_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default=None,
                   help="a Hugging Face folder, a .gguf file, or with --load-format dummy a "
                        "preset name such as llama-3-8b (default: SmolLM2-135M-Instruct)")
    p.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                   help="dummy: random weights of the model's shape")
    p.add_argument("--dataset-seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--output-json", type=Path, default=None, help="write the results here")
    _engine_arguments(p.add_argument_group("engine options (EngineArgs)"))


def _engine_arguments(g) -> None:
    from slipstream.spec.cli import SPEC_FLAGS
    for name, (kind, default, help_) in ENGINE_OPTIONS.items():
        flags = ["--" + name.replace("_", "-")]
        # generate / chat / serve spell some speculative flags shorter (--spec-tree): both work
        if SPEC_FLAGS.get(name, flags[0]) != flags[0]:
            flags.append(SPEC_FLAGS[name])
        if name == "speculative_auto_off":
            flags.append("--spec-auto-off")           # and so --no-spec-auto-off
        if kind is bool:
            g.add_argument(*flags, dest=name, action=argparse.BooleanOptionalAction,
                           default=default, help=help_)
        else:
            g.add_argument(*flags, dest=name, type=kind, default=default, help=help_)


def _engine_args(args):
    from slipstream.engine.args import EngineArgs
    kw = {name: getattr(args, name) for name in ENGINE_OPTIONS}
    return EngineArgs(model=args.model, load_format=args.load_format, **kw)


def _make_llm(args):
    from slipstream.llm import LLM
    ea = _engine_args(args)
    t0 = time.perf_counter()
    opts = {f.name: getattr(ea, f.name) for f in fields(ea) if f.name != "model"}
    llm = LLM(ea.model, **opts)
    cfg = llm.engine.config
    from slipstream.commands.options import weights_summary
    quant, _ = weights_summary(getattr(llm.engine.runner, "model", None), cfg.quantization)
    dummy = ", random" if args.load_format == "dummy" else ""
    print(f"loaded {cfg.model} ({cfg.model_config.architecture}, "
          f"{str(cfg.dtype).removeprefix('torch.')}, {cfg.device}, weights: {quant}{dummy}) "
          f"in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return llm


def _meta(llm, args) -> dict:
    import torch
    cfg = llm.engine.config
    dev = torch.device(cfg.device)
    return {"model": cfg.model, "load_format": args.load_format,
            "dtype": str(cfg.dtype).removeprefix("torch."), "device": str(dev),
            "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def _write(args, res: dict) -> None:
    if args.output_json is not None:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps(res, indent=1))
        print(f"wrote {args.output_json}", file=sys.stderr)


def run_latency(args) -> int:
    import torch
    from slipstream.analysis.hardware import measure_copy_bandwidth
    from slipstream.bench import latency
    latency.validate(args)
    llm = _make_llm(args)
    dev = torch.device(llm.engine.config.device)
    copy_bw = measure_copy_bandwidth(dev) if dev.type == "cuda" else None
    res = {"meta": _meta(llm, args), **latency.run(llm.engine, args, copy_bw)}
    print(latency.report(res))
    _write(args, res)
    return 0


def run_throughput(args) -> int:
    import torch
    from slipstream.analysis.hardware import (HardwareProfile, device_name,
                                              measure_copy_bandwidth, measure_matmul_rate)
    from slipstream.bench import throughput
    llm = _make_llm(args)
    cfg = llm.engine.config
    dev = torch.device(cfg.device)
    # The bound uses this device's ceilings, measured now, for the engine's dtype.
    name = device_name(dev)
    hw = HardwareProfile(name, measure_copy_bandwidth(dev), measure_matmul_rate(dev, cfg.dtype),
                         source=f"measured on {name}")
    res = {"meta": _meta(llm, args), **throughput.run(llm, args, hw)}
    print(throughput.report(res))
    _write(args, res)
    return 0

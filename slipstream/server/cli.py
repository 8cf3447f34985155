"""`slipstream serve`: the OpenAI-compatible server on uvicorn."""
from __future__ import annotations

import argparse
import os
import sys
import time


def add_parser(subparsers) -> argparse.ArgumentParser:
    from slipstream.commands.options import add_engine_options
    p = subparsers.add_parser(
        "serve", help="serve the OpenAI API (completions, chat, streaming) and a chat page",
        description="An OpenAI-compatible server: POST /v1/completions, POST /v1/chat/completions, "
                    "GET /v1/models, /health, /metrics, POST /tokenize and /detokenize "
                    "(vLLM's), and a chat page at /.")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=os.environ.get("SLIPSTREAM_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health and "
                        "the chat page (default: $SLIPSTREAM_API_KEY; none: open)")
    g.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the model file's stem)")
    g.add_argument("--max-queued-requests", type=int, default=1024,
                   help="sequences that may wait beyond --max-num-seqs; more answer 503")
    g.add_argument("--max-request-bytes", type=int, default=2 << 20,
                   help="largest request body; larger ones answer 413")
    g.add_argument("--drain-timeout", type=float, default=120.0,
                   help="seconds SIGTERM waits for in-flight requests before exiting")
    g.add_argument("--log-level", default="info", help="uvicorn log level")
    e = p.add_argument_group("engine capacity")
    e.add_argument("--max-num-seqs", type=int, default=256, help="requests running at once")
    e.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget per step")
    e.add_argument("--num-kv-blocks", type=int, default=None, help="fixed KV pool size")
    e.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    e.add_argument("--seed", type=int, default=0, help="seed of unseeded sampling")
    e.add_argument("--gpu-memory-utilization", type=float, default=0.90,
                   help="share of GPU memory the engine may use")
    e.add_argument("--async-scheduling", choices=("auto", "on", "off"), default="auto",
                   help="overlap host work with the device's step (auto: on with CUDA)")
    e.add_argument("--no-graph-warmup", action="store_true",
                   help="capture CUDA graphs on their first use instead of before serving")
    d = p.add_argument_group("prefill/decode disaggregation")
    d.add_argument("--prefill-device", default=None,
                   help="compute prompts in a second process on this device (e.g. cuda:1; "
                        "cpu with a CPU engine) and hand their K/V to this one, which decodes; "
                        "with --tensor-parallel-size N each instance takes N GPUs from its "
                        "device on")
    add_engine_options(p)
    p.set_defaults(func=run)
    return p


def _check(args) -> None:
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_queued_requests < 0:
        raise ValueError("--max-queued-requests must be at least 0")
    if args.max_request_bytes < 1024:
        raise ValueError("--max-request-bytes must be at least 1024")
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError("--api-key must not be empty")
    from slipstream.commands.options import DEVICE_PATTERN
    if args.prefill_device is not None and (args.prefill_device == "auto"
                                            or not DEVICE_PATTERN.fullmatch(args.prefill_device)):
        raise ValueError(f"--prefill-device: expected cpu, cuda or cuda:N, got "
                         f"{args.prefill_device!r}")
    if getattr(args, "spec_device_loop", False):
        raise ValueError("--spec-device-loop answers one prompt at a time (LLM.generate, "
                         "`slipstream generate` and `chat`); the server batches its requests "
                         "through the engine's speculation rounds: drop --spec-device-loop")


def make_engine(args):
    from slipstream.engine.args import EngineArgs
    from slipstream.engine.engine import Engine
    names = EngineArgs.field_names()
    opts = dict(model=args.model, dtype=args.dtype, device=args.device,
                max_model_len=args.max_model_len, attention_backend=args.attention_backend,
                kv_cache_memory=args.kv_cache_memory, kv_cache_dtype=args.kv_cache_dtype,
                enable_prefix_caching=not args.no_prefix_caching, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                num_kv_blocks=args.num_kv_blocks, block_size=args.block_size, seed=args.seed,
                gpu_memory_utilization=args.gpu_memory_utilization,
                enforce_eager=args.enforce_eager,
                async_scheduling={"auto": None, "on": True, "off": False}[args.async_scheduling])
    opts.update(load_format=args.load_format, tensor_parallel_size=args.tensor_parallel_size,
                quantization=None if args.quantization == "none" else args.quantization)
    from slipstream.commands.options import check_spec_options
    from slipstream.spec.cli import spec_engine_args
    opts.update(spec_engine_args(args))
    if args.threads is not None:
        import torch
        torch.set_num_threads(args.threads)
    engine_args = EngineArgs(**{k: v for k, v in opts.items() if k in names})
    check_spec_options(engine_args)
    if getattr(args, "prefill_device", None):
        from slipstream.distributed.prefill_decode import PDEngine
        return PDEngine(engine_args, args.prefill_device)
    return Engine(engine_args)


def run(args) -> int:
    _check(args)
    try:
        import uvicorn

        from slipstream.server.api_server import build_app
    except ImportError as e:
        raise ValueError(f"serve needs the server packages ({e.name} is missing): "
                         "pip install 'slipstream[serve]'") from None
    t0 = time.perf_counter()
    print("loading model ...", file=sys.stderr, flush=True)
    engine = make_engine(args)
    cfg = engine.config
    name = args.served_model_name or _default_name(cfg.model)
    print(f"loaded {cfg.model} as '{name}' ({cfg.device}, max_model_len {engine.max_model_len}) "
          f"in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    if not args.no_graph_warmup:
        from slipstream.engine.warmup import capture_graphs
        capture_graphs(engine, log=lambda line: print(line, file=sys.stderr, flush=True))
    app = build_app(engine, name, api_key=args.api_key, max_queued=args.max_queued_requests,
                    max_request_bytes=args.max_request_bytes)
    from slipstream.engine import gc_heap
    gc_heap.serving()       # the start-up heap out of the collector's way (engine/gc_heap.py)
    print(f"serving on http://{args.host}:{args.port} (chat page at /)"
          + (" with an API key" if args.api_key else ""), file=sys.stderr, flush=True)
    # uvicorn's SIGTERM/SIGINT handling stops accepting connections, waits for the
    # open ones (streams included) up to the drain timeout, then runs the lifespan
    # shutdown, which stops the engine thread.
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.drain_timeout, access_log=False)
    try:
        _server_class()(config).run()
    finally:
        shutdown = getattr(engine, "shutdown", None)
        if shutdown is not None:    # worker and prefill processes
            shutdown()
    return 0


def _server_class():
    import signal

    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn re-raises a caught SIGTERM after its graceful shutdown, so the process
        would end killed by the signal; after a complete drain it exits with status 0."""

        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            captured = getattr(self, "_captured_signals", None)
            if sig == signal.SIGTERM and captured and captured[-1] == sig:
                captured.pop()
    return DrainingServer


def _default_name(model_path: str) -> str:
    from pathlib import Path
    p = Path(model_path)
    return p.stem if p.suffix == ".gguf" else p.name

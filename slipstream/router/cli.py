"""`slipstream router`: a KV-aware router in front of several `slipstream serve` instances."""
from __future__ import annotations

import argparse
import os
import sys


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "router", help="route OpenAI API requests to the instance caching their prefix",
        description="Serves the OpenAI API of `slipstream serve` in front of several instances: "
                    "each request goes to the instance whose prefix cache holds the longest "
                    "prefix of its prompt (instances report their cached block hashes), else to "
                    "the least loaded one; dead instances are skipped.")
    p.add_argument("--instances", required=True,
                   help="comma-separated instance URLs, e.g. http://127.0.0.1:8001,http://127.0.0.1:8002")
    p.add_argument("--model", "-m", default=None,
                   help="the instances' model (its tokenizer hashes the prompts as they do; "
                        "default: the default model)")
    p.add_argument("--load-format", default="auto", choices=("auto", "dummy"),
                   help="dummy: the instances run random weights (--model may be a preset)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--poll-interval", type=float, default=0.5,
                   help="seconds between polls of the instances' cache state and health")
    p.add_argument("--max-imbalance", type=int, default=8,
                   help="a cached prefix wins unless its instance has this many more requests "
                        "in flight than the least loaded one")
    p.add_argument("--connect-timeout", type=float, default=3.0,
                   help="seconds to reach an instance before trying another")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds an instance may stay silent while answering")
    p.add_argument("--api-key", default=os.environ.get("SLIPSTREAM_API_KEY"),
                   help="the key the instances were started with (their --api-key): the "
                        "router's polls carry it; clients' requests carry their own, which the "
                        "instances check (default: $SLIPSTREAM_API_KEY)")
    p.add_argument("--log-level", default="info", help="uvicorn log level")
    p.set_defaults(func=run)
    return p


def _check(args) -> list[str]:
    urls = [u.strip() for u in args.instances.split(",") if u.strip()]
    for u in urls:
        if not u.startswith(("http://", "https://")):
            raise ValueError(f"--instances: {u!r} is not an http:// URL")
        if u.startswith("https://"):
            raise ValueError(f"--instances: {u!r}: the router speaks plain HTTP to its instances")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    for name in ("poll_interval", "connect_timeout", "request_timeout"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive")
    return urls


def run(args) -> int:
    urls = _check(args)
    from slipstream.router.policy import Router
    router = Router(urls, args.max_imbalance)
    try:
        import uvicorn

        from slipstream.router.app import RouterServer, build_router_app
    except ImportError as e:
        raise ValueError(f"router needs the server packages ({e.name} is missing): "
                         "pip install 'slipstream[serve]'") from None
    from slipstream.loader import open_model
    tokenizer = open_model(args.model, args.load_format).tokenizer()
    server = RouterServer(router, tokenizer, args.poll_interval, args.connect_timeout,
                          args.request_timeout, api_key=args.api_key)
    print(f"routing to {', '.join(urls)}; serving on http://{args.host}:{args.port}",
          file=sys.stderr, flush=True)
    uvicorn.run(build_router_app(server), host=args.host, port=args.port,
                log_level=args.log_level, access_log=False)
    return 0

"""`slipstream train-draft`: train Medusa / EAGLE heads for a target model."""
from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    p = sub.add_parser("train-draft", help="train Medusa or EAGLE draft heads on the "
                       "target's own answers (CPU)")
    p.add_argument("--method", nargs="+", default=["medusa", "eagle"],
                   choices=["medusa", "eagle"], help="which heads to train")
    p.add_argument("--model", default=None, help="target model (default: SmolLM2-135M-Instruct)")
    p.add_argument("--prompts", default=None,
                   help="prompt file, one per line (default: the shipped training prompts)")
    p.add_argument("--max-tokens", type=int, default=96, help="answer length per prompt")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="slipstream/spec/weights",
                   help="directory for <model>.<method>.safetensors")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from slipstream.spec.train import train_draft
    if args.max_tokens < 2 or args.epochs < 1:
        raise ValueError("--max-tokens must be >= 2 and --epochs >= 1")
    train_draft(args.method, args.model, args.out, args.prompts, args.max_tokens, args.epochs,
                args.seed)
    return 0

"""`slipstream generate PROMPT`: complete one prompt, streaming the text.

A model with a chat template (an instruct model) gets the prompt as a user
message inside its template, as llama.cpp's CLI and Ollama do: a raw question
makes such a model end its turn at once. `--raw` sends the text as is.
"""
from __future__ import annotations

import argparse
import sys

from slipstream.commands import options

HELP = "complete a prompt, streaming the text"


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("generate", help=HELP, description=HELP + ". " + __doc__.split("\n\n")[1])
    p.add_argument("prompt", help="the text to complete (a user message for chat models)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--chat", action="store_true",
                      help="wrap the prompt in the model's chat template (the default when it has one)")
    mode.add_argument("--raw", action="store_true",
                      help="send the prompt as is, without the chat template")
    options.add_engine_options(p)
    options.add_sampling_options(p)
    return p


def run(args) -> int:
    if not args.prompt.strip():
        raise ValueError('the prompt is empty; give the text to complete, e.g. '
                         'slipstream generate "Once upon a time"')
    params = options.sampling_params(args)
    engine = options.make_engine(args)
    tok = engine.tokenizer
    has_template = tok.chat_template is not None
    if args.chat and not has_template:
        raise ValueError("--chat: the model has no chat template; drop --chat")
    if has_template and not args.raw:
        text = tok.apply_chat_template([{"role": "user", "content": args.prompt}])
        prompt = {"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)}
    else:
        prompt = args.prompt
    n_prompt = len(prompt["prompt_token_ids"]) if isinstance(prompt, dict) else len(tok.encode(prompt))
    _, n, secs, ttft, reason, stop_reason = options.stream(engine, prompt, params)
    options.report(n, secs, ttft)
    options.note_context_limit(engine, n_prompt, n, reason, params.max_tokens)
    if args.raw and has_template and reason == "stop" and stop_reason is None and n <= 1:
        print("[the model ended its turn at once: it is a chat model and expects its chat "
              "template; drop --raw to apply it]", file=sys.stderr)
    return 0

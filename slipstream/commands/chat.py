"""`slipstream chat`: talk with the model, multi-turn, in its chat template."""
from __future__ import annotations

import argparse
import re
import sys

from slipstream.commands import options

HELP = "talk with the model (multi-turn, chat template)"
COMMANDS = {"/help": "list these commands", "/reset": "clear the conversation",
            "/exit": "quit (also /quit or Ctrl-D)"}
# A line whose first word looks like a command (`/foo`, not a path like `/usr/bin`)
SLASH = re.compile(r"/[A-Za-z][\w-]*")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("chat", help=HELP, description=HELP + "; /reset clears the "
                              "conversation, /exit or Ctrl-D quits, /help lists the commands")
    p.add_argument("--system", default=None, help="a system message")
    p.add_argument("--verbose", "-v", action="store_true", help="print speed after each reply")
    options.add_engine_options(p)
    options.add_sampling_options(p)
    return p


def run(args) -> int:
    params = options.sampling_params(args)
    engine = options.make_engine(args)
    tok = engine.tokenizer
    if tok.chat_template is None:
        raise ValueError("the model has no chat template; use `slipstream generate` to complete text")
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("chat: type a message; /reset clears the conversation, /exit or Ctrl-D quits, "
          "/help lists the commands.", file=sys.stderr)
    while True:
        try:
            # The "> " prompt only where someone types: piped in, the replies alone go out.
            line = input("> " if sys.stdin.isatty() else "")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if not line.strip():
            continue
        word = line.split()[0]
        if word.startswith("//"):          # a message that begins with "/"
            line = line.replace("/", "", 1)
        elif SLASH.fullmatch(word):
            if word in ("/exit", "/quit"):
                return 0
            if word == "/reset":
                messages = messages[:1] if args.system else []
            elif word == "/help":
                for name, text in COMMANDS.items():
                    print(f"  {name:<7} {text}", file=sys.stderr)
                print("  start a message with // to send one that begins with /", file=sys.stderr)
            else:
                print(f"unknown command {word}; /help lists them", file=sys.stderr)
            continue
        messages.append({"role": "user", "content": line})
        text = tok.apply_chat_template(messages, add_generation_prompt=True)
        ids = tok.encode(text, add_special_tokens=False)
        try:
            reply, n, secs, ttft, reason, _ = options.stream(engine, {"prompt": text, "prompt_token_ids": ids}, params)
        except ValueError as e:  # e.g. the conversation outgrew the context
            messages.pop()
            print(f"error: {e}; /reset starts a new conversation", file=sys.stderr)
            continue
        messages.append({"role": "assistant", "content": reply})
        options.note_context_limit(engine, len(ids), n, reason, params.max_tokens)
        if args.verbose:
            options.report(n, secs, ttft)

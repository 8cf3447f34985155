"""`slipstream <command>`: a table of subcommands, each imported only when run.

A subcommand is a module with `add_parser(subparsers) -> ArgumentParser` and
`run(args) -> int` (or a `func` default set by its parser); a module with
`add_parsers(subparsers)` instead gets a parser of its own whose subcommands it
adds (`bench latency`, `bench throughput`). Adding one is a
line in COMMANDS. Only the chosen command's module is imported, and none
imports torch at module level, so `slipstream --help`, `slipstream generate
--help` and option errors answer without loading torch or a model.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help shown by `slipstream --help`)
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("slipstream.commands.generate", "complete a prompt, streaming the text"),
    "chat": ("slipstream.commands.chat", "talk with the model (multi-turn, chat template)"),
    "analyze": ("slipstream.analysis.cli", "FLOPs, bytes, roofline bounds; spec-decode theory"),
    "bench": ("slipstream.bench.cli", "benchmarks: latency, throughput, serve, spec"),
    "serve": ("slipstream.server.cli", "an OpenAI-compatible HTTP server"),
    "router": ("slipstream.router.cli", "a KV-aware router in front of several servers"),
    "quantize": ("slipstream.quant.cli", "quantize a checkpoint (RTN, GPTQ, AWQ, SmoothQuant, mixed)"),
    "eval": ("slipstream.eval.cli", "evaluate a model (perplexity)"),
    "train-draft": ("slipstream.spec.cli", "train Medusa / EAGLE draft heads on the target's answers"),
}


class Parser(argparse.ArgumentParser):
    """An option error is one line naming the option (not the whole usage);
    subcommands' parsers are of this class too."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; `command`'s module is imported and mounted, the others are listed only."""
    parser = Parser(prog="slipstream", description="Fast, exact LLM inference.")
    from slipstream import __version__
    parser.add_argument("--version", action="version", version=f"slipstream {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")
    for name, (module, help_text) in COMMANDS.items():
        if name != command:
            sub.add_parser(name, help=help_text, add_help=False)
            continue
        mod = importlib.import_module(module)
        if not hasattr(mod, "add_parser"):
            mod.add_parsers(sub.add_parser(name, help=help_text).add_subparsers(dest=name, required=True))
            continue
        p = mod.add_parser(sub)
        if p is not None and p.get_default("func") is None:
            p.set_defaults(func=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in COMMANDS else None)
    args, extra = parser.parse_known_args(argv)
    if extra:   # named by the subcommand that refused them, whose --help lists its options
        prog = " ".join(["slipstream", args.command] + ([getattr(args, args.command)]
                                                        if isinstance(getattr(args, args.command, None), str)
                                                        else []))
        parser.exit(2, f"{prog}: error: unrecognized arguments: {' '.join(extra)} "
                       f"(see {prog} --help)\n")
    from slipstream.errors import SlipstreamError
    try:
        return args.func(args) or 0
    except (SlipstreamError, ValueError, FileNotFoundError) as e:
        print(f"error: {_with_flags(str(e), args)}", file=sys.stderr)
        return 2


def _with_flags(message: str, args: argparse.Namespace) -> str:
    """The engine names its options as Python does (`tensor_parallel_size=3`); on
    the command line they read as the flags that set them (`--tensor-parallel-size=3`)."""
    return name_flags(message, {name: "--" + name.replace("_", "-") for name in vars(args)
                                if "_" in name})


def name_flags(message: str, flags: dict[str, str]) -> str:
    """`message` with each field name in `flags` replaced by its flag, longest first."""
    for name in sorted(flags, key=len, reverse=True):
        message = message.replace(name, flags[name])
    return message


if __name__ == "__main__":
    sys.exit(main())

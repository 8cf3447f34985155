"""The `slipstream` subcommands that run a model (generate, chat). Each module
exposes `add_parser(subparsers)` and `run(args)`; none imports torch at module
level, so `--help` and option errors answer at once."""

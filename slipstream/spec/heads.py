"""Where trained draft heads live: a path the user names, or the heads that
ship for the default model (made by `slipstream train-draft`, see
benchmarks/spec/README.md for the exact command and data)."""
from __future__ import annotations

from pathlib import Path

SHIPPED_DIR = Path(__file__).parent / "weights"
SHIPPED = {"medusa": "smollm2-135m-instruct.medusa.safetensors",
           "eagle": "smollm2-135m-instruct.eagle.safetensors"}


def resolve_head(path: str | None, kind: str) -> Path:
    if path is not None:
        p = Path(path).expanduser()
        if not p.is_file():
            raise ValueError(f"speculative_model: no {kind} head file at {str(p)!r}")
        return p
    p = SHIPPED_DIR / SHIPPED[kind]
    if not p.is_file():
        raise ValueError(f"speculative_model: no {kind} head was named and none ships "
                         f"at {p}; train one with `slipstream train-draft --method {kind}`")
    return p

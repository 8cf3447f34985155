"""Reading the JSON files of a model folder, with one clear error when one is bad."""
from __future__ import annotations

import json
from pathlib import Path

from slipstream.errors import ModelLoadError


def read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: cannot read it as JSON ({e})") from None
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, found {type(value).__name__}")
    return value

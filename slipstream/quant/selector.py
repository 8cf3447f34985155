"""Resolves `EngineConfig.quantization` to the model's `QuantMethodFor`."""
from __future__ import annotations

import importlib

from slipstream.quant.base import QuantMethodFor, registered_schemes

# Scheme name -> module that registers it (imported only when asked for).
_BUILTIN: dict[str, str] = {"gguf": "slipstream.quant.gguf"}


def quant_method_for(config, files) -> QuantMethodFor | None:
    """None when the model runs unquantized (dense weights in the model dtype)."""
    name = config.quantization
    if name is None:
        return None
    if name not in registered_schemes() and name in _BUILTIN:
        importlib.import_module(_BUILTIN[name])
    try:
        factory = registered_schemes()[name]
    except KeyError:
        known = sorted(set(registered_schemes()) | set(_BUILTIN))
        raise ValueError(f"quantization: unknown {name!r}; choose from {known}") from None
    return factory(config, files)

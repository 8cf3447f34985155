"""The registry of quantization schemes and the per-layer choice of `QuantMethod`.

A scheme is a factory `(EngineConfig, ModelFiles) -> QuantMethodFor`: given a
linear layer's module name ("model.layers.0.self_attn.qkv_proj") it returns the
layer's `QuantMethod`, or None to keep the layer unquantized. Schemes register
themselves with `register_scheme` when their module is imported; `selector.py`
imports them on demand.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from slipstream.config import EngineConfig
    from slipstream.layers.linear import QuantMethod

# Picks the QuantMethod of each linear layer by its module name; None keeps it dense.
QuantMethodFor = Callable[[str], "QuantMethod | None"]
SchemeFactory = Callable[["EngineConfig", object], QuantMethodFor]

_SCHEMES: dict[str, SchemeFactory] = {}


def register_scheme(name: str):
    def deco(factory: SchemeFactory) -> SchemeFactory:
        _SCHEMES[name] = factory
        return factory
    return deco


def registered_schemes() -> dict[str, SchemeFactory]:
    return _SCHEMES

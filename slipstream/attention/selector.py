"""Picks and builds an attention backend by name.

The built-in backends register themselves in `base` when imported; this module
imports them (the Triton one only when asked for or on CUDA), so `base` stays a
protocol and a registry.
"""
from __future__ import annotations

import os

import torch

from slipstream.attention.base import _BACKENDS, AttentionBackend


def create_backend(name: str | None, device: torch.device) -> AttentionBackend:
    # Import the built-in backends so they register themselves.
    from slipstream.attention import torch_backend  # noqa: F401
    if name is None:
        name = default_backend_name(device)
    elif name == "triton":
        if device.type != "cuda" and not os.environ.get("TRITON_INTERPRET"):
            raise ValueError("attention_backend: 'triton' needs a CUDA device "
                             "(or TRITON_INTERPRET=1 for the slow interpreter)")
        from slipstream.attention import triton_backend  # noqa: F401
    try:
        return _BACKENDS[name]()
    except KeyError:
        raise ValueError(f"attention_backend: unknown {name!r}; choose from {sorted(_BACKENDS)}") from None


def default_backend_name(device: torch.device) -> str:
    if device.type == "cuda":
        try:
            from slipstream.attention import triton_backend  # noqa: F401
        except ImportError:
            return "torch"
        if "triton" in _BACKENDS:
            return "triton"
    return "torch"

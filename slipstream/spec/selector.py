"""Builds a proposer by name. The proposer modules register themselves in
`base` when imported; importing them is this module's job, so `base` stays a
protocol and a registry."""
from __future__ import annotations

import importlib

from slipstream.spec.base import _PROPOSERS, Proposer, proposer_names

_BUILTIN = {"draft": "slipstream.spec.draft_model", "ngram": "slipstream.spec.ngram",
            "medusa": "slipstream.spec.medusa", "eagle": "slipstream.spec.eagle",
            "peagle": "slipstream.spec.peagle"}


def create_proposer(name: str, **kwargs) -> Proposer:
    """kwargs: spec (SpecConfig), device, dtype, target (the target model), block_size."""
    if name not in _PROPOSERS and name in _BUILTIN:
        importlib.import_module(_BUILTIN[name])
    try:
        factory = _PROPOSERS[name]
    except KeyError:
        known = sorted(set(proposer_names()) | set(_BUILTIN))
        raise ValueError(f"speculative_method: unknown {name!r}; choose from {known}") from None
    return factory(**kwargs)

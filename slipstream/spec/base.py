"""The proposer protocol and registry.

A proposer is stateful per request (a draft model keeps its own KV cache, an
EAGLE head its own features): `propose` is called once per step with every
speculating request, and `release` when a request leaves.

Alignment of `ProposeRequest.hidden` (used by Medusa and EAGLE): with L =
len(token_ids), the last token (position L - 1) is the draft's root, chosen
but not yet run through the target. `hidden` holds the target's final hidden
states at positions [L - 1 - m, L - 1), those computed (and kept) since the
previous call for this request; hidden[-1] is the state whose logits chose
the root.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch

from slipstream.spec.tree import DraftTree


@dataclass
class ProposeRequest:
    request_id: str
    token_ids: Sequence[int]            # prompt + output so far; the last one is the root
    hidden: torch.Tensor | None = None  # [m, hidden_size] target states (see module docstring)
    num_tokens: int | None = None       # draft budget this step (None: the proposer's own)


class Proposer(Protocol):
    # Whether `propose` reads ProposeRequest.hidden (the runner then keeps them).
    needs_hidden: bool

    def propose(self, requests: list[ProposeRequest]) -> list[DraftTree]:
        """One draft tree per request (possibly empty)."""
        ...

    def release(self, request_id: str) -> None:
        """Forget a finished or preempted request's state."""
        ...


_PROPOSERS: dict[str, Callable[..., Proposer]] = {}


def register_proposer(name: str):
    def wrap(factory):
        _PROPOSERS[name] = factory
        return factory
    return wrap


def proposer_names() -> list[str]:
    return sorted(_PROPOSERS)

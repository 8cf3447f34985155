"""Prompt-lookup (n-gram) drafting: no model at all.

Find the most recent earlier occurrence of the request's last n tokens in its
own history (prompt and output), longest n first, and propose the k tokens
that followed it. It pays where outputs copy their input (summaries, code
edits, quoting, repetitive text) and costs almost nothing where they don't.
"""
from __future__ import annotations

import numpy as np
import torch

from slipstream.spec.base import ProposeRequest, register_proposer
from slipstream.spec.tree import DraftTree


def lookup(tokens: np.ndarray, max_n: int, min_n: int, k: int) -> np.ndarray:
    """tokens: [L] int64 history. The up-to-k tokens that followed the latest
    earlier match of the longest suffix of length in [min_n, max_n]; empty when
    none matches."""
    length = tokens.shape[0]
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        # windows[i] = tokens[i:i + n], for starts whose match ends before the suffix.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:length - 1], n)
        hits = np.nonzero((windows == suffix).all(axis=1))[0]
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start:start + k]
    return tokens[:0]


class NgramProposer:
    needs_hidden = False

    def __init__(self, num_speculative_tokens: int = 4, max_n: int = 4, min_n: int = 1,
                 device: torch.device | str = "cpu"):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram sizes: need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        if num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be at least 1")
        self.k, self.max_n, self.min_n = num_speculative_tokens, max_n, min_n
        self.device = device

    def propose(self, requests: list[ProposeRequest]) -> list[DraftTree]:
        out = []
        for r in requests:
            k = self.k if r.num_tokens is None else r.num_tokens
            found = lookup(np.asarray(r.token_ids, dtype=np.int64), self.max_n, self.min_n, k)
            # Host tokens: the runner copies them to the device with the step's
            # inputs (no copy back and forth).
            out.append(DraftTree.chain(torch.from_numpy(found.copy())))
        return out

    def release(self, request_id: str) -> None:
        pass


@register_proposer("ngram")
def _make(spec, device, **_):
    return NgramProposer(spec.num_speculative_tokens, spec.ngram_max, spec.ngram_min, device)

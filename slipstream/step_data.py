"""What the scheduler tells the model runner each step: plain, serializable data.

The runner keeps its own state per request (token ids, block table row,
sampling parameters) and learns only what changed: requests it has not seen
(or that come back after a preemption, whose state it dropped), per-request
deltas (blocks appended, progress), and requests that left. It never reads the
scheduler's live `Request` objects, so the same data can be sent to
tensor-parallel workers or across a process boundary.

Invariant (per request r scheduled this step, with n = num_scheduled_tokens[r]):
the step computes the tokens at positions [num_computed_tokens, num_computed_tokens + n)
of r, and r samples a new token when that range ends at the last token the runner
holds for r (its prompt, outputs, and outputs still being sampled).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from slipstream.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]   # known outputs (non-empty after a preemption)
    params: SamplingParams
    eos_token_ids: tuple[int, ...]  # () when the request ignores EOS
    block_ids: list[int]
    num_computed_tokens: int      # before this step (prefix-cache hits)
    max_tokens: int               # after the context-length cap


@dataclass
class CachedRequestData:
    req_id: str
    new_block_ids: list[int]      # appended to the request's block table
    num_computed_tokens: int      # before this step


@dataclass
class SchedulerOutput:
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    # Tokens to compute per request, in the step's order.
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    # Requests that left since the last step (finished, aborted, preempted):
    # the runner drops their state.
    finished_req_ids: list[str] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)
    # Speculative decoding: request id -> (draft token ids, parent of each: -1 =
    # the request's last token), verified after that token this step; the
    # request's num_scheduled_tokens is 1 + len(draft).
    spec_drafts: dict[str, tuple[list[int], tuple[int, ...]]] = field(default_factory=dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


@dataclass
class StepOutput:
    """What one forward produced, on the host. Token lists per request: one token
    per sampling request (more once drafts are verified)."""
    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list["TokenLogprobs"]] = field(default_factory=dict)
    # request id -> (index of the first prompt position scored, records)
    prompt_logprobs: dict[str, tuple[int, list["TokenLogprobs"]]] = field(default_factory=dict)
    # Drafts proposed for each request's next step (same form as spec_drafts).
    drafts: dict[str, tuple[list[int], tuple[int, ...]]] = field(default_factory=dict)
    # request id -> (draft tokens verified, of them accepted) in this step.
    spec_counts: dict[str, tuple[int, int]] = field(default_factory=dict)


@dataclass
class TokenLogprobs:
    """Log-probabilities at one position: the chosen token's, its rank, and
    the top alternatives (ids and log-probs, best first)."""
    token_id: int
    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]

    @classmethod
    def from_row(cls, ids: list[int], vals: list[float], rank: int, k: int) -> "TokenLogprobs":
        """A row of `layers.logprobs.LogprobsTensors` on the host: column 0 is
        the chosen token, then the top alternatives; keep k of them (-1: all)."""
        top = len(ids) - 1 if k < 0 else k
        return cls(int(ids[0]), vals[0], int(rank), [int(i) for i in ids[1:1 + top]], vals[1:1 + top])

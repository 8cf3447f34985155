"""A request's life: tokens, progress through the KV cache, and why it ended."""
from __future__ import annotations

import enum

from slipstream.cache.prefix_cache import BlockHasher
from slipstream.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything from here on is finished.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {RequestStatus.FINISHED_STOPPED: "stop",
                RequestStatus.FINISHED_LENGTH: "length",
                RequestStatus.FINISHED_ABORTED: "abort"}.get(self)


class Request:
    """One sequence being generated. `num_computed_tokens` counts the tokens
    whose K/V are in the cache; the request is caught up (and samples) when it
    reaches `num_tokens`. There is no separate prefill phase."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: tuple[int, ...], max_model_len: int, block_hasher: BlockHasher | None,
                 prompt: str | None = None):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(prompt_token_ids)
        self.params = params
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        # Tokens being sampled by launched steps whose output has not arrived.
        self.num_pending = 0
        # Speculative decoding: the draft proposed for the next step, and the
        # number of draft tokens the step in flight verifies.
        self.spec_draft: tuple[list[int], tuple[int, ...]] | None = None
        self.num_spec_scheduled = 0
        self.num_cached_tokens = 0   # prompt tokens found in the prefix cache on admission
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        self.eos_token_ids = () if params.ignore_eos else eos_token_ids
        self.stop_token_ids = frozenset(params.stop_token_ids or ())
        room = max_model_len - len(prompt_token_ids)
        self.max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        # Per-token log-probability records (filled by the engine when asked for).
        self.logprobs: list[dict] = []
        self.prompt_logprobs: list[dict | None] = []
        # Chained hashes of the full blocks of all_token_ids (prefix caching).
        self._hasher = block_hasher
        self.block_hashes: list[bytes] = []
        if block_hasher is not None:
            block_hasher.extend(self.block_hashes, self.all_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self._hasher is not None:
            self._hasher.extend(self.block_hashes, self.all_token_ids)

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drop the output tokens after the first `num_output_tokens` (a stop string
        matched inside a step that accepted several tokens)."""
        cut = self.num_output_tokens - num_output_tokens
        if cut <= 0:
            return
        del self.output_token_ids[num_output_tokens:]
        del self.all_token_ids[len(self.all_token_ids) - cut:]
        if self._hasher is not None:
            del self.block_hashes[len(self.all_token_ids) // self._hasher.block_size:]

    def check_stop(self) -> bool:
        """Token-level stop conditions after a token was appended (stop strings
        are the detokenizer's business). Sets status and stop_reason."""
        last = self.output_token_ids[-1]
        if self.num_output_tokens >= self.params.min_tokens:
            if last in self.eos_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                return True
            if last in self.stop_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = last
                return True
        if self.num_output_tokens >= self.max_tokens:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

"""Iteration-level scheduling under a token budget.

Every step each running request gets the tokens it still has to compute (one
decode token, or the rest of a prompt chunk), then waiting requests are
admitted with prompt chunks while the budget lasts. Long prompts are split
across steps (chunked prefill) and share steps with decodes. When the KV pool
runs dry the newest running request is preempted: its blocks are freed and it
is recomputed later from its tokens, so its output does not change.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from slipstream.cache.kv_manager import KVCacheManager
from slipstream.config import SchedulerConfig
from slipstream.engine.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    context_len: int   # tokens already in the cache before this step
    block_ids: list[int] = field(default_factory=list)  # the request's KV blocks, in order
    # The step reaches the request's last token, so it yields a new one.
    samples: bool = False

    def __post_init__(self):
        self.samples = self.context_len + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self._allocate_or_preempt(req, n, out):
                break
            out.scheduled.append(ScheduledRequest(req, n, req.num_computed_tokens))
            budget -= n
            i += 1
        # Admit new work only when nothing had to make room this step.
        while (not out.preempted and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            req = self.waiting[0]
            hits = self.kv.get_computed_blocks(req)
            num_hit_tokens = len(hits) * self.kv.block_size
            n = req.num_tokens - num_hit_tokens
            if n > budget and not self.config.enable_chunked_prefill:
                break
            n = min(n, budget)
            if not self.kv.allocate_slots(req, n, hits):
                break
            self.waiting.popleft()
            if req.num_preemptions == 0:
                req.num_cached_tokens = num_hit_tokens
            req.num_computed_tokens = num_hit_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, n, num_hit_tokens))
            budget -= n
        for s in out.scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
            s.block_ids = self.kv.block_ids(s.request.request_id)
        return out

    def _allocate_or_preempt(self, req: Request, n: int, out: SchedulerOutput) -> bool:
        while not self.kv.allocate_slots(req, n):
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim.request_id)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Append the step's sampled tokens, apply token-level stops, and free
        finished requests. Returns the requests that got a new token."""
        advanced = []
        for s in out.scheduled:
            req = s.request
            if req.status.is_finished or req.request_id not in sampled:
                continue
            req.append_token(sampled[req.request_id])
            advanced.append(req)
            if req.check_stop():
                self._release(req)
        return advanced

    def finish_request(self, request_id: str, status: RequestStatus,
                       stop_reason: int | str | None = None) -> None:
        req = self.requests.get(request_id)
        if req is None:
            return
        if not req.status.is_finished:
            req.status = status
            req.stop_reason = stop_reason
        self._release(req)

    def _release(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)
        self.requests.pop(req.request_id, None)

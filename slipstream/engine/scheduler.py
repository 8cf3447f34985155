"""Iteration-level scheduling under a token budget.

Every step each running request gets the tokens it still has to compute (one
decode token, or the rest of a prompt chunk), then waiting requests are
admitted with prompt chunks while the budget lasts. Long prompts are split
across steps (chunked prefill) and share steps with decodes. When the KV pool
runs dry the newest running request is preempted: its blocks are freed and it
is recomputed later from its tokens, so its output does not change.

Steps may be scheduled before the previous step's tokens are known (the
engine overlaps host work with the GPU): a request whose last scheduled step
samples holds `num_pending` placeholder tokens until the step's output lands.
Its next decode token is scheduled at once (the runner reads the token from
the device); if the pending token turns out to end the request, that one
extra step's work is discarded. The output is the same as without overlap.

The output is plain step data (`step_data.SchedulerOutput`): new requests,
per-request deltas and the ids that left, never live `Request` objects.
"""
from __future__ import annotations

from collections import deque

from slipstream.cache.kv_manager import KVCacheManager
from slipstream.config import SchedulerConfig
from slipstream.engine.request import Request, RequestStatus
from slipstream.step_data import CachedRequestData, NewRequestData, SchedulerOutput

_CUT_SIZES = (0, 1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 48)   # draft nodes


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # Blocks the runner already knows of, per request it holds state for.
        self._sent_blocks: dict[str, int] = {}
        # Requests the runner holds state for that left since the last step.
        self._gone: list[str] = []
        self._preempted: list[str] = []

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @staticmethod
    def _tokens_to_compute(req: Request) -> int:
        n = req.num_tokens + req.num_pending - req.num_computed_tokens
        # A request whose pending tokens take it to max_tokens finishes with them.
        if req.num_output_tokens + req.num_pending >= req.max_tokens:
            return 0
        return n

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted_now = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(self._tokens_to_compute(req), budget)
            if n <= 0:
                i += 1
                continue
            draft = self._take_draft(req, n, budget)
            ok, preempted = self._allocate_or_preempt(req, n + len(draft[0]))
            preempted_now |= preempted
            if not ok:
                break
            if draft[0]:
                out.spec_drafts[req.request_id] = draft
                req.num_spec_scheduled = len(draft[0])
                n += len(draft[0])
            scheduled.append((req, n))
            budget -= n
            i += 1
        # Admit new work only when nothing had to make room this step.
        while (not preempted_now and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            req = self.waiting[0]
            if req.num_pending:  # preempted while a token was in flight: wait for it
                break
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
            scheduled.append((req, n))
            budget -= n
        if out.spec_drafts and any(n > 1 and r.request_id not in out.spec_drafts
                                   for r, n in scheduled):
            scheduled = [self._chain_only(r, n, out) for r, n in scheduled]
        for req, n in scheduled:
            self._emit(req, n, out)
            req.num_computed_tokens += n
            # Draft tokens lie past the request's tokens; the step samples when
            # it reaches the last real one.
            if req.num_computed_tokens - req.num_spec_scheduled == req.num_tokens + req.num_pending:
                req.num_pending += 1   # this step samples its next token
        if scheduled:  # the ids that left reach the runner with the next step it runs
            out.finished_req_ids, self._gone = self._gone, []
            out.preempted_req_ids, self._preempted = self._preempted, []
        return out

    def _take_draft(self, req: Request, n: int, budget: int) -> tuple[list[int], tuple[int, ...]]:
        """The request's draft, cut to what fits: the token budget, max_tokens
        (verification emits up to len + 1 tokens) and the context length. A
        tree's first m nodes are a tree (parents precede children)."""
        draft, req.spec_draft = req.spec_draft, None
        if draft is None or n != 1 or req.num_pending:
            return [], ()
        room = min(budget - 1, req.max_tokens - req.num_output_tokens - 1,
                   self.config.max_model_len - req.num_tokens)
        m = max(0, min(len(draft[0]), room))
        if m < len(draft[0]):
            # A cut draft keeps one of a few sizes: each row count of a verification
            # step is a CUDA graph of its own (captured once, on first use).
            m = max(size for size in _CUT_SIZES if size <= m)
        return list(draft[0][:m]), tuple(draft[1][:m])

    @staticmethod
    def _chain_only(req: Request, n: int, out: SchedulerOutput) -> tuple[Request, int]:
        """Trees are verified in steps of decodes only (the tree-attention
        kernel takes at most 64 query rows per request); in a step with prompt
        chunks a tree is cut to its leftmost branch, a chain."""
        draft = out.spec_drafts.get(req.request_id)
        if draft is None or all(p == j - 1 for j, p in enumerate(draft[1])):
            return req, n
        tokens, parents = draft
        path, cur = [], -1
        while True:
            nxt = next((j for j, p in enumerate(parents) if p == cur), None)
            if nxt is None:
                break
            path.append(nxt)
            cur = nxt
        chain = [tokens[j] for j in path]
        out.spec_drafts[req.request_id] = (chain, tuple(range(-1, len(chain) - 1)))
        req.num_spec_scheduled = len(chain)
        return req, 1 + len(chain)

    def _emit(self, req: Request, n: int, out: SchedulerOutput) -> None:
        rid = req.request_id
        blocks = self.kv.block_ids(rid)
        sent = self._sent_blocks.get(rid)
        if sent is None:
            out.new_requests.append(NewRequestData(
                req_id=rid, prompt_token_ids=req.prompt_token_ids,
                output_token_ids=list(req.output_token_ids), params=req.params,
                eos_token_ids=req.eos_token_ids, block_ids=blocks,
                num_computed_tokens=req.num_computed_tokens, max_tokens=req.max_tokens))
        else:
            out.cached_requests.append(CachedRequestData(
                req_id=rid, new_block_ids=blocks[sent:],
                num_computed_tokens=req.num_computed_tokens))
        self._sent_blocks[rid] = len(blocks)
        out.num_scheduled_tokens[rid] = n

    def _allocate_or_preempt(self, req: Request, n: int) -> tuple[bool, bool]:
        preempted = False
        while not self.kv.allocate_slots(req, n):
            victim = self.running.pop()
            self._preempt(victim)
            preempted = True
            if victim is req:
                return False, True
        return True, preempted

    def _forget(self, req: Request) -> None:
        # A preempted request that ends before it runs again is news too: the
        # runner keeps its random stream until it comes back.
        if self._sent_blocks.pop(req.request_id, None) is not None or req.num_preemptions:
            self._gone.append(req.request_id)

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        self._forget(req)
        self._preempted.append(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_draft, req.num_spec_scheduled = None, 0
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    def update(self, sampled: dict[str, list[int]],
               drafts: dict[str, tuple[list[int], tuple[int, ...]]] | None = None) -> list[Request]:
        """Append a step's sampled tokens, apply token-level stops, and free
        finished requests. With speculation, a request's list holds its
        accepted drafts then one more token; the rejected drafts' cache
        positions are given back (their slots are rewritten later), and the
        next step's draft is stored. Returns the requests that got new tokens."""
        advanced = []
        for rid, tokens in sampled.items():
            req = self.requests.get(rid)
            if req is None:          # finished or aborted while the step ran
                continue
            req.num_pending -= 1
            if req.num_spec_scheduled:
                req.num_computed_tokens -= req.num_spec_scheduled - (len(tokens) - 1)
                req.num_spec_scheduled = 0
            if req.status.is_finished:
                continue
            if drafts:
                req.spec_draft = drafts.get(rid)
            for t in tokens:
                req.append_token(t)
                if req.check_stop():
                    self._release(req)
                    break
            advanced.append(req)
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
        self._forget(req)
        self.requests.pop(req.request_id, None)

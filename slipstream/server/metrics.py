"""Prometheus metrics of the server: queue, KV cache, prefix cache, latencies, tokens.

Latencies are measured where the client sees them (arrival at the API to the
output reaching the request's queue). Gauges of engine state come from the
snapshot the stepping thread takes after each step, so a scrape never reads
the engine while it runs. Speculative-decoding counters are fed from
`RequestOutput.extra["num_draft_tokens"]` / `["num_accepted_tokens"]` (per
request, cumulative) when the engine reports them.
"""
from __future__ import annotations

import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from slipstream.engine.outputs import RequestOutput

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5,
                    2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_RATE_WINDOW_S = 10.0


class _Tracked:
    __slots__ = ("arrival", "last_time", "tokens", "draft", "accepted", "prompt_seen")

    def __init__(self, arrival: float):
        self.arrival = arrival
        self.last_time: float | None = None
        self.tokens = 0
        self.draft = 0
        self.accepted = 0
        self.prompt_seen = False


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        self.waiting = Gauge("slipstream_requests_waiting", "Sequences queued in the scheduler",
                             registry=r)
        self.running = Gauge("slipstream_requests_running", "Sequences running in the engine",
                             registry=r)
        self.in_flight = Gauge("slipstream_requests_in_flight", "Requests the server is handling",
                               registry=r)
        self.kv_usage = Gauge("slipstream_kv_cache_usage", "Share of KV blocks in use (0-1)",
                              registry=r)
        self.kv_free = Gauge("slipstream_kv_cache_free_blocks", "Free KV blocks", registry=r)
        self.kv_total = Gauge("slipstream_kv_cache_blocks", "KV blocks in the pool", registry=r)
        self.prompt_tokens = Counter("slipstream_prompt_tokens", "Prompt tokens processed",
                                     registry=r)
        self.cached_tokens = Counter("slipstream_prefix_cache_hit_tokens",
                                     "Prompt tokens found in the prefix cache", registry=r)
        self.hit_rate = Gauge("slipstream_prefix_cache_hit_rate",
                              "Share of prompt tokens served from the prefix cache", registry=r)
        self.gen_tokens = Counter("slipstream_generation_tokens", "Tokens generated", registry=r)
        self.tokens_per_s = Gauge("slipstream_generation_tokens_per_second",
                                  f"Tokens generated per second over the last {_RATE_WINDOW_S:g} s",
                                  registry=r)
        self.ttft = Histogram("slipstream_time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("slipstream_inter_token_latency_seconds",
                             "Time between generated tokens", buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("slipstream_e2e_request_latency_seconds", "Request latency",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.requests = Counter("slipstream_requests", "Requests by outcome", ["outcome"],
                                registry=r)
        self.spec_draft = Counter("slipstream_spec_draft_tokens", "Draft tokens proposed",
                                  registry=r)
        self.spec_accepted = Counter("slipstream_spec_accepted_tokens", "Draft tokens accepted",
                                     registry=r)
        self.spec_rate = Gauge("slipstream_spec_acceptance_rate",
                               "Accepted / proposed draft tokens (0 before any draft)", registry=r)
        self.step_errors = Gauge("slipstream_engine_step_errors", "Engine steps that raised",
                                 registry=r)
        info = Gauge("slipstream_model_info", "The served model", ["model"], registry=r)
        info.labels(model=model_name).set(1)
        self._tracked: dict[str, _Tracked] = {}
        self._recent: deque[tuple[float, int]] = deque()
        self._prompt_total = 0
        self._cached_total = 0
        self._draft_total = 0
        self._accepted_total = 0

    # ---- per request (on the loop) ----------------------------------------

    def arrived(self, request_id: str, when: float | None = None) -> None:
        """`when`: time.monotonic() at which the HTTP request came in (default: now)."""
        self._tracked[request_id] = _Tracked(time.monotonic() if when is None else when)

    def finished(self, request_id: str, outcome: str) -> None:
        t = self._tracked.pop(request_id, None)
        self.requests.labels(outcome=outcome).inc()
        if t is not None and outcome == "ok":
            self.e2e.observe(time.monotonic() - t.arrival)

    def observe(self, out: RequestOutput, now: float) -> None:
        t = self._tracked.get(out.request_id)
        if t is None:
            return
        if not t.prompt_seen:
            t.prompt_seen = True
            self._prompt_total += len(out.prompt_token_ids)
            self._cached_total += out.num_cached_tokens
            self.prompt_tokens.inc(len(out.prompt_token_ids))
            self.cached_tokens.inc(out.num_cached_tokens)
            self.hit_rate.set(self._cached_total / max(1, self._prompt_total))
        tokens = sum(len(c.token_ids) for c in out.outputs)
        new = tokens - t.tokens
        if new > 0:
            if t.last_time is None:
                self.ttft.observe(now - t.arrival)
            else:
                per_token = (now - t.last_time) / new
                for _ in range(min(new, 64)):
                    self.itl.observe(per_token)
            t.last_time, t.tokens = now, tokens
            self.gen_tokens.inc(new)
            self._recent.append((now, new))
        draft, accepted = out.extra.get("num_draft_tokens"), out.extra.get("num_accepted_tokens")
        if draft is not None and accepted is not None:
            self.spec_draft.inc(max(0, draft - t.draft))
            self.spec_accepted.inc(max(0, accepted - t.accepted))
            self._draft_total += max(0, draft - t.draft)
            self._accepted_total += max(0, accepted - t.accepted)
            t.draft, t.accepted = draft, accepted
            self.spec_rate.set(self._accepted_total / max(1, self._draft_total))

    # ---- a scrape ---------------------------------------------------------

    def render(self, stats, in_flight: int) -> bytes:
        self.waiting.set(stats.waiting)
        self.running.set(stats.running)
        self.in_flight.set(in_flight)
        self.kv_usage.set(stats.kv_usage)
        self.kv_free.set(stats.kv_free_blocks)
        self.kv_total.set(stats.kv_total_blocks)
        self.step_errors.set(stats.step_errors)
        now = time.monotonic()
        while self._recent and self._recent[0][0] < now - _RATE_WINDOW_S:
            self._recent.popleft()
        self.tokens_per_s.set(sum(n for _, n in self._recent) / _RATE_WINDOW_S)
        return generate_latest(self.registry)

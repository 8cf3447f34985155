"""The engine behind an asyncio server: one thread steps it, each request reads its own queue.

The engine is not thread-safe and `step()` is blocking compute, so a single
background thread owns it: it takes new requests and aborts from an inbox,
runs steps while work remains, and hands each step's outputs to the asyncio
loop in one `call_soon_threadsafe` call, where they land in per-request
queues. A slow reader only lets its own queue grow; nobody else waits on it.

An exception inside `step()` fails the requests of that step (they get a
`StepError`, which the API answers with a 500-class error), they are aborted
so their KV blocks return to the pool, and the loop goes on with the rest.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass

from slipstream.engine.outputs import RequestOutput
from slipstream.sampling_params import SamplingParams

log = logging.getLogger("slipstream.server")


class StepError(RuntimeError):
    """The engine raised while computing a step this request was part of."""


class Overloaded(RuntimeError):
    """The server holds as many requests as it may queue."""


class TooLarge(ValueError):
    """One request alone holds more sequences than the server ever takes at once."""


class EngineStopped(RuntimeError):
    """The engine can take no new request (a tensor-parallel rank or the prefill
    instance of a pair died); `/health` says so too."""


@dataclass
class EngineStats:
    """A snapshot the stepping thread takes after every step (read by /metrics)."""
    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0
    kv_free_blocks: int = 0
    kv_total_blocks: int = 0
    steps: int = 0
    step_errors: int = 0


class AsyncEngine:
    def __init__(self, engine, max_queued: int = 1024, on_output=None):
        """`max_queued`: sequences that may wait beyond the engine's running capacity
        (`max_num_seqs`); a request that would pass that limit raises Overloaded.
        `on_output(request_output, now)` is called on the loop for every output."""
        self.engine = engine
        self.capacity = engine.config.scheduler.max_num_seqs + max_queued
        self.on_output = on_output
        self.stats = EngineStats()
        self.stopped: str | None = None     # why the engine takes no new request
        self._inbox: list[tuple] = []
        self._aborts: list[str] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._queues: dict[str, asyncio.Queue] = {}
        self._num_seqs: dict[str, int] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._snapshot()

    # ---- lifecycle (called on the loop) ------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="slipstream-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    @property
    def num_in_flight(self) -> int:
        return sum(self._num_seqs.values())

    # ---- requests (called on the loop) -------------------------------------

    def submit(self, items: list[tuple[object, SamplingParams, str]]) -> "Submission":
        """Queue requests `(prompt, params, request_id)` that share one output queue.
        Raises Overloaded (queueing nothing) when they would pass the capacity."""
        if self.stopped is not None:
            raise EngineStopped(f"the engine takes no new requests: {self.stopped}")
        seqs = sum(params.n for _, params, _ in items)
        if seqs > self.capacity:      # no wait would make room: not a retry-later 503
            raise TooLarge(f"n: the request asks for {seqs} sequences (prompts x n), more than "
                           f"the server runs and queues at once ({self.capacity}); send fewer "
                           "prompts or a smaller n")
        if self.num_in_flight + seqs > self.capacity:
            raise Overloaded(f"the server is full ({self.num_in_flight} sequences in flight, "
                             f"at most {self.capacity}); retry later")
        sub = Submission(self, [rid for _, _, rid in items])
        for _, params, rid in items:
            self._queues[rid] = sub.queue
            self._num_seqs[rid] = params.n
        with self._lock:
            self._inbox.extend(items)
        self._wake.set()
        return sub

    def _release(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        self._num_seqs.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.append(request_id)
        self._wake.set()

    # ---- the stepping thread ----------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        while True:
            with self._lock:
                inbox, self._inbox = self._inbox, []
                aborts, self._aborts = self._aborts, []
                self._wake.clear()
            for prompt, params, rid in inbox:
                try:
                    engine.add_request(prompt, params, rid)
                except Exception as e:  # noqa: BLE001 - handed to the request, not raised here
                    if getattr(e, "stops_engine", False):
                        self.stopped = str(e)
                    if not isinstance(e, ValueError):
                        e = StepError(f"the engine cannot take this request: {e}")
                    self._deliver([(rid, e)])
            for rid in aborts:
                try:
                    engine.abort_request(rid)
                except Exception:  # noqa: BLE001
                    log.exception("abort of request %s failed", rid)
            if self._stop:
                # Shutdown comes after the HTTP side drained: whatever is left has no
                # reader any more (a drain timeout cut it off), so it is aborted.
                for rid in self._unfinished_ids():
                    try:
                        engine.abort_request(rid)
                    except Exception:  # noqa: BLE001
                        log.exception("abort of request %s failed", rid)
                break
            if not engine.has_unfinished_requests():
                self._snapshot()
                self._wake.wait(0.5)
                continue
            self._step()
        self._snapshot()

    def _step(self) -> None:
        engine = self.engine
        in_step = self._running_ids()
        try:
            outputs = engine.step()
        except Exception as e:  # noqa: BLE001 - one bad step must not stop the server
            self.stats.step_errors += 1
            if getattr(e, "stops_engine", False):
                self.stopped = str(e)
            lost = getattr(e, "request_ids", None)
            if lost is not None:
                # The engine names the requests it lost (a prefill/decode pair whose
                # prefill instance died); the others go on.
                log.error("%s", e)
                err = StepError(f"the engine lost this request: {e}")
                self._deliver([(rid, err) for rid in {r.split("#", 1)[0] for r in lost}])
                self._snapshot()
                return
            log.exception("a step failed; failing its requests")
            failed = in_step or self._unfinished_ids()
            err = StepError(f"the engine failed while computing this request: "
                            f"{type(e).__name__}: {e}")
            for rid in failed:
                try:
                    engine.abort_request(rid)
                except Exception:  # noqa: BLE001
                    log.exception("abort of request %s failed", rid)
            self._deliver([(rid, err) for rid in failed])
            self._snapshot()
            return
        self.stats.steps += 1
        self._snapshot()
        if outputs:
            self._deliver([(o.request_id, o) for o in outputs])

    def _running_ids(self) -> set[str]:
        """User request ids of the sequences the scheduler is running (the ones a step
        computes). Sequence ids are `rid` or `rid#i` (n > 1 fan-out)."""
        running = getattr(getattr(self.engine, "scheduler", None), "running", None)
        if running is None:
            return set()
        try:
            return {r.request_id.split("#", 1)[0] for r in list(running)}
        except Exception:  # noqa: BLE001 - engine internals changed: fall back to all
            return set()

    def _unfinished_ids(self) -> set[str]:
        parents = getattr(self.engine, "_parents", None)
        if parents is not None:
            return set(parents)
        return set(self._queues)

    def _snapshot(self) -> None:
        engine, s = self.engine, self.stats
        sched = getattr(engine, "scheduler", None)
        s.waiting = len(getattr(sched, "waiting", ()))
        s.running = len(getattr(sched, "running", ()))
        pool = engine.kv.pool
        s.kv_free_blocks = pool.num_free_blocks
        s.kv_total_blocks = pool.num_blocks
        s.kv_usage = 1.0 - s.kv_free_blocks / max(1, s.kv_total_blocks)

    def _deliver(self, items: list[tuple[str, object]]) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._dispatch, items)
        except RuntimeError:  # the loop closed between the check and the call
            pass

    def _dispatch(self, items: list[tuple[str, object]]) -> None:
        now = time.monotonic()
        for rid, item in items:
            if self.on_output is not None and isinstance(item, RequestOutput):
                self.on_output(item, now)
            queue = self._queues.get(rid)
            if queue is not None:
                queue.put_nowait(item if isinstance(item, RequestOutput) else (rid, item))


class Submission:
    """The outputs of a group of requests (one prompt each), read from one queue.

    Iterate it for `RequestOutput`s in arrival order; an engine failure of one
    of its requests is raised from the iteration. `close()` aborts whatever has
    not finished (a client that went away), and is safe to call twice."""

    def __init__(self, owner: AsyncEngine, request_ids: list[str]):
        self.owner = owner
        self.request_ids = request_ids
        self.queue: asyncio.Queue = asyncio.Queue()
        self._open = set(request_ids)

    @property
    def done(self) -> bool:
        return not self._open

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._open:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, tuple):  # (request_id, exception)
            rid, exc = item
            self._finish(rid)
            raise exc
        if item.finished:
            self._finish(item.request_id)
        return item

    def _finish(self, request_id: str) -> None:
        self._open.discard(request_id)
        self.owner._release(request_id)

    def close(self) -> None:
        for rid in list(self._open):
            self._finish(rid)
            self.owner.abort(rid)

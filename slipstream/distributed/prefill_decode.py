"""Prefill/decode disaggregation: prompts computed by one instance, decoded by another.

`PDEngine` is the decode instance, in the caller's process, with the `Engine`
interface (`add_request`, `step`, `abort_request`, `has_unfinished_requests`),
so `DisaggregatedLLM` (and anything built on an engine) drives it as usual. It
starts the prefill instance in a second process (torch.multiprocessing spawn);
the two join one link (`kv_transfer.py`: NCCL between GPUs, gloo on the CPU).

Either instance may be tensor-parallel (`tensor_parallel_size`, the same for
both): each then starts its other ranks, all 2 x N processes join one world
(`parallel.World`), and each rank pair moves its own shard of the K/V. On GPUs
the decode instance takes N GPUs from its device on and the prefill instance N
from `prefill_device` on (default: the N after the decode instance's).

A request's life:
  1. decode side: tokenized, sent to the prefill instance (a message);
  2. prefill side: computed as a 1-token request of its engine (the sampled
     token is discarded); once done, the K/V of its full prompt blocks are
     gathered and sent: a header message, then one tensor;
  3. decode side, on a receiving thread: the tensor arrives; between steps the
     engine thread writes it into its pool as prefix-cache blocks and adds the
     request, which is admitted as a prefix hit: it computes only the prompt's
     tail and samples from there, exactly as a single instance would.

Failure: the prefill process is watched (its exit code) and the link's
receiving thread fails once the peer's sockets close, so a dead prefill
instance makes the next `step` raise `PeerDiedError` naming the requests that
were waiting for their prompt, within about a second; requests already
decoding go on, and new ones are refused.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import threading
import time
import weakref
from dataclasses import replace

import torch
import torch.multiprocessing as mp

from slipstream.distributed.kv_transfer import (DECODE_RANK, LINK_TIMEOUT, PREFILL_RANK,
                                                ReceiveBlocks, Transfer, close_link, import_blocks,
                                                kv_layout, placed)
from slipstream.distributed.parallel import World, host_store
from slipstream.distributed.prefill_instance import prefill_main, start_instance
from slipstream.distributed.worker import cpu_threads_per_rank
from slipstream.engine.args import EngineArgs
from slipstream.errors import SlipstreamError
from slipstream.llm import LLM, checked_max_logprobs

log = logging.getLogger("slipstream")


class PeerDiedError(SlipstreamError, RuntimeError):
    """The other instance of a prefill/decode pair stopped. `request_ids`: the requests
    it took with it (those waiting for their prompt), raised once by the `step` that found
    out; requests already decoding go on."""
    stops_engine = True     # no new prompt can be computed: a server refuses new requests

    def __init__(self, message: str, request_ids: list[str] | None = None):
        super().__init__(message)
        self.request_ids = list(request_ids or [])


class PDEngine:
    def __init__(self, args: EngineArgs, prefill_device: str | None = None):
        if not args.enable_prefix_caching:
            raise ValueError("enable_prefix_caching: prefill/decode disaggregation hands the "
                             "prompt's K/V over as prefix-cache blocks; turn it on")
        if str(getattr(args, "kv_cache_dtype", None)).startswith("kivi"):
            raise ValueError("kv_cache_dtype: a KIVI cache does not move between prefill and "
                             "decode instances (int8 / fp8 ones do)")
        from slipstream.config import resolve_device
        tp = args.tensor_parallel_size
        device = resolve_device(args.device)
        if prefill_device is None:
            prefill_device = f"cuda:{tp}" if device.type == "cuda" else str(device)
        if device.type == "cpu" and torch.device(prefill_device).type != "cpu":
            raise ValueError(f"prefill_device: a CPU decode instance pairs with a CPU prefill "
                             f"instance, got {prefill_device!r}")
        p_device = resolve_device(prefill_device)
        if device.type == "cuda":
            if device.index is None:
                device = torch.device("cuda", 0)
            mine = range(device.index, device.index + tp)
            if p_device.type != "cuda" or p_device.index is None or \
                    set(mine) & set(range(p_device.index, p_device.index + tp)):
                raise ValueError(f"prefill_device: the prefill instance needs GPUs of its own "
                                 f"(the decode instance runs on {_gpus(device, tp)}), got "
                                 f"{prefill_device!r}" + (f" (it would take {_gpus(p_device, tp)})"
                                                          if p_device.index is not None else ""))
        self._threads = torch.get_num_threads()
        if device.type == "cpu":
            torch.set_num_threads(cpu_threads_per_rank(2 * tp))
        store = host_store(2 * tp)
        gpu = (lambda d: d.index) if device.type == "cuda" else (lambda d: 0)
        world = World(store.port, tp, DECODE_RANK, gpu(device))
        p_world = replace(world, index=PREFILL_RANK, first_gpu=gpu(p_device))
        p_args = replace(args, device=str(p_device))
        self._proc = mp.get_context("spawn").Process(
            target=prefill_main, args=(p_world, p_args), name="slipstream-prefill",
            daemon=tp == 1)   # a daemon cannot start its own ranks; the finalizer kills it
        self._proc.start()
        self._finalizer = weakref.finalize(self, _kill, self._proc)
        self._failed: str | None = None
        self.link = None
        try:
            self._wait_joined(store)
            self.engine, self.link = start_instance(world, args, device)
            self._rx: queue.Queue = queue.Queue()
            threading.Thread(target=self._receive, name="slipstream-kv-recv", daemon=True).start()
            ready = self._wait_message(LINK_TIMEOUT.total_seconds() * 5, "start")
        except Exception:
            self.shutdown()
            raise
        mine = kv_layout(self.engine.runner)
        if ready[0] != "ready" or tuple(ready[1]) != tuple(mine[0]) or ready[2] != str(mine[1]):
            self.shutdown()
            raise ValueError(f"the prefill instance's KV layout {ready[1:]} differs from the "
                             f"decode instance's {mine}: both must run the same model, dtype "
                             "and block_size")
        self._pending: dict[str, tuple] = {}     # sent for prefill: (prompt ids, params, text)
        self._aborted: set[str] = set()
        self._ids = itertools.count()
        self.transfers: list[Transfer] = []
        self._sends: list = []   # messages on their way to the prefill instance

    # ---- the Engine interface ---------------------------------------------------

    def __getattr__(self, name):   # config, tokenizer, kv, scheduler, runner, max_model_len
        if name in ("engine", "link", "_proc", "_failed"):
            raise AttributeError(name)
        return getattr(self.engine, name)

    def tokenize(self, prompt):
        return self.engine.tokenize(prompt)

    def add_request(self, prompt, params=None, request_id: str | None = None) -> str:
        from slipstream.sampling_params import SamplingParams
        self._check_alive()
        params = params or SamplingParams()
        text, ids = self.engine.tokenize(prompt)
        request_id = f"pd-{next(self._ids)}" if request_id is None else request_id
        if request_id in self._pending or request_id in self.engine._parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self._pending[request_id] = (ids, params, text)
        try:
            self._sends = [s for s in self._sends if not s[0].is_completed()]
            self._sends += self.link.send_message(("prefill", request_id, ids), wait=False)
        except RuntimeError as e:
            self._fail(e)
        return request_id

    def abort_request(self, request_id: str) -> None:
        if request_id in self._pending:
            self._pending.pop(request_id)
            self._aborted.add(request_id)   # its K/V, when it comes, is dropped
        self.engine.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._pending) or self.engine.has_unfinished_requests()

    @property
    def _parents(self) -> dict:
        """Every unfinished request: waiting for its prompt, or on the decode instance."""
        return {**dict.fromkeys(self._pending), **self.engine._parents}

    def step(self, finished_only: bool = False):
        """Take in the prompts whose K/V arrived, then run one decode-instance step
        (`Engine.step`'s finished_only). Once the prefill instance is gone (the step that
        finds out raises PeerDiedError naming the requests lost with it), steps go on for
        the requests already decoding."""
        if self._failed is None:
            self._take_arrivals(block=not self.engine.has_unfinished_requests())
        if self.engine.has_unfinished_requests():
            return self.engine.step(finished_only)
        return []

    def shutdown(self) -> None:
        if self.link is not None and self._failed is None:
            try:   # not waiting for the send: a prefill process that stopped reading is killed
                pending = self.link.send_message(None, wait=False)
            except RuntimeError:
                pending = []
            self._proc.join(timeout=10)
            del pending
        self._failed = self._failed or "the engine was shut down"
        _kill(self._proc)
        if getattr(self, "engine", None) is not None:
            self.engine.shutdown()   # its other ranks, under tensor parallelism
        close_link()
        self.link = None
        torch.set_num_threads(self._threads)

    # ---- arrivals -------------------------------------------------------------

    def _receive(self) -> None:
        """The receiving thread: (header, K/V tensor) pairs into the queue, or the error."""
        link = self.link
        try:
            stream = contextlib.nullcontext()
            if link.device.type == "cuda":
                torch.cuda.set_device(link.device)
                # Its own stream: waiting for a transfer must not wait for the engine's steps.
                stream = torch.cuda.stream(torch.cuda.Stream(link.device))
            with stream:
                while True:
                    msg = link.recv_message()
                    if msg is None or msg[0] != "kv":
                        self._rx.put(msg)
                        continue
                    _, rid, shape, dtype = msg
                    t0 = time.perf_counter()
                    dtype = getattr(torch, dtype.removeprefix("torch."))
                    kv = (link.recv_tensor(shape, dtype) if shape[2] else   # none sent: no full block
                          torch.empty(shape, dtype=dtype, device=link.device))
                    self._rx.put(("kv", rid, kv, time.perf_counter() - t0))
        except Exception as e:  # noqa: BLE001 - the peer went away: handed to the engine thread
            self._rx.put(e)

    def _wait_message(self, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while True:
            try:
                item = self._rx.get(timeout=0.1)
            except queue.Empty:
                self._check_alive()
                if time.monotonic() > deadline:
                    self._fail(TimeoutError(f"the prefill instance did not {what} within "
                                            f"{timeout:.0f} s"))
                continue
            if isinstance(item, BaseException):
                self._fail(item)
            return item

    def _take_arrivals(self, block: bool) -> None:
        self._check_alive()
        while True:
            try:
                item = self._rx.get(timeout=0.05) if block and self._pending else self._rx.get_nowait()
            except queue.Empty:
                self._check_alive()
                return
            block = False
            if isinstance(item, BaseException):
                self._fail(item)
            _, rid, kv, recv_s = item
            tp = self.engine.config.parallel.tensor_parallel_size
            if rid in self._aborted:
                self._aborted.discard(rid)
                if tp > 1 and kv.shape[2]:   # the other ranks' shards: received, dropped
                    self.engine.runner.command(ReceiveBlocks(kv.shape[2], [], []))
                continue
            ids, params, text = self._pending.pop(rid)
            t0 = time.perf_counter()
            where = import_blocks(self.engine, ids, kv)
            if tp > 1 and kv.shape[2]:   # the other ranks write their shards the same way
                self.engine.runner.command(where)
            n = placed(self.engine, ids, kv.shape[2])
            bs = self.engine.kv.block_size
            self.transfers.append(Transfer(rid, len(ids), kv.shape[2] * bs,
                                           kv.numel() * kv.element_size() * tp, recv_s,
                                           time.perf_counter() - t0, n * bs))
            prompt = {"prompt_token_ids": ids} if text is None else {"prompt": text,
                                                                     "prompt_token_ids": ids}
            self.engine.add_request(prompt, params, rid)

    # ---- failure --------------------------------------------------------------

    def _wait_joined(self, store) -> None:
        deadline = time.monotonic() + LINK_TIMEOUT.total_seconds()
        while not store.check(["pd/joined"]):
            if not self._proc.is_alive():   # before joining: most often the user's script
                self._failed = (f"the prefill instance (pid {self._proc.pid}) exited with code "
                                f"{self._proc.exitcode} before joining (its error is printed "
                                "above; a script that starts a prefill/decode pair needs an "
                                "`if __name__ == '__main__':` guard, since the prefill "
                                "process imports it)")
                raise PeerDiedError(self._failed)
            if time.monotonic() > deadline:
                self._fail(TimeoutError("the prefill instance did not start"))
            time.sleep(0.02)

    def _check_alive(self) -> None:
        if self._failed is not None:
            raise PeerDiedError(self._failed)
        if not self._proc.is_alive():
            self._fail(None)

    def _fail(self, error: BaseException | None):
        time.sleep(0.05)   # a dying process's exit code lands a moment after its sockets close
        if not self._proc.is_alive():
            reason = f"the prefill instance (pid {self._proc.pid}) exited with code {self._proc.exitcode}"
        else:
            reason = f"the link to the prefill instance failed: {error}"
        lost = sorted(getattr(self, "_pending", {}))
        if hasattr(self, "_pending"):
            self._pending.clear()
        # Not naming the lost requests: the message reaches every client's error body
        # (the log names them).
        if lost:
            log.error("requests lost with the prefill instance: %s", ", ".join(lost))
        self._failed = (f"{reason}; {len(lost)} request(s) waiting for their prompt were "
                        "failed; requests already decoding go on, new ones are refused")
        _kill(self._proc)
        raise PeerDiedError(self._failed, lost) from error


def _gpus(device: torch.device, n: int) -> str:
    return str(device) if n == 1 else f"cuda:{device.index}..cuda:{device.index + n - 1}"


def _kill(proc) -> None:
    if proc.is_alive():
        proc.kill()
    proc.join(timeout=5)


class DisaggregatedLLM(LLM):
    """`LLM` over a prefill/decode pair: `generate` and `chat` as usual; prompts are
    computed by a second process and their K/V handed over. `prefill_device`:
    where the prefill instance runs (default: cuda:1 next to a cuda:0 decode
    instance, else the CPU). Call `shutdown()` when done."""

    def __init__(self, model: str | None = None, prefill_device: str | None = None, *,
                 max_logprobs: int = 20, **kwargs):
        unknown = set(kwargs) - EngineArgs.field_names()
        if unknown:
            raise TypeError(f"DisaggregatedLLM() got unknown options: {', '.join(sorted(unknown))}")
        self.max_logprobs = checked_max_logprobs(max_logprobs)
        self.engine = PDEngine(EngineArgs(model=model, **kwargs), prefill_device)

    @property
    def transfers(self) -> list[Transfer]:
        return self.engine.transfers

    def shutdown(self) -> None:
        self.engine.shutdown()

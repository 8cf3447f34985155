"""Rank 0's side of tensor parallelism: the `ModelRunner` interface over N ranks.

`TPExecutor` starts ranks 1..N-1 (torch.multiprocessing spawn; under torchrun
they already run), joins them in one `TPGroup`, and holds rank 0's own
`ModelRunner`. `execute(sched)` broadcasts the step's `SchedulerOutput` to the
workers, then runs rank 0's share of the step; every rank runs the same step,
and sampling happens on rank 0, whose tokens the runner broadcasts.

Failure: before each step rank 0 checks that its workers live; a collective
that fails (a peer's sockets closed, or COLLECTIVE_TIMEOUT_S passed) ends the
step. Either way the engine raises `WorkerDiedError`, stops the other ranks
and refuses further steps: it never hangs on a dead rank.
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import sys
import threading
import time
import weakref
from dataclasses import replace

import torch
import torch.multiprocessing as mp

from slipstream.distributed import comm
from slipstream.distributed.kv_transfer import LINK_TIMEOUT
from slipstream.distributed.parallel import (COLLECTIVE_TIMEOUT_S, World, destroy_tp_group,
                                             host_store, init_tp_group, init_world, join_store,
                                             rank_device, torchrun_rank)
from slipstream.distributed.rank_profile import ProfileCommand, RankProfiler
from slipstream.distributed.worker import cpu_threads_per_rank, run_worker, spawned_worker
from slipstream.errors import SlipstreamError
from slipstream.runner.model_runner import ModelRunner, StepHandle
from slipstream.step_data import SchedulerOutput, StepOutput

log = logging.getLogger("slipstream")


class WorkerDiedError(SlipstreamError, RuntimeError):
    """A tensor-parallel rank stopped; the engine cannot run further steps."""
    stops_engine = True     # a server answers no new request after it (server/async_engine.py)


# The executor whose process group this process holds (a weak reference: an engine
# dropped without shutdown() leaves the group, which the next executor takes down).
_group_owner: weakref.ref | None = None


class TPExecutor:
    def __init__(self, args, config, files, quant_method_for, world: World | None = None):
        """world: the larger world this instance is one of (a prefill/decode pair);
        None: its own."""
        global _group_owner
        size = config.parallel.tensor_parallel_size
        if torch.distributed.is_initialized() and _group_owner is not None and _group_owner() is None:
            destroy_tp_group()      # left by an engine dropped without shutdown(): its ranks are gone
            _group_owner = None
        if torch.distributed.is_initialized():
            raise RuntimeError("torch.distributed is already initialised in this process (another "
                               "tensor-parallel engine, or the script's own process group); "
                               "shut that down first (llm.shutdown() or Engine.shutdown())")
        self.size = size
        self.tp = None   # set once this engine's process group exists
        self._threads = torch.get_num_threads()
        self._procs: list = []
        self._failed: str | None = None
        self._profiler: RankProfiler | None = None
        env = torchrun_rank() if world is None else None
        if world is not None:
            if world.tp != size:
                raise ValueError(f"tensor_parallel_size={size} but the world's instances have "
                                 f"{world.tp} ranks")
            if config.device.type == "cuda" and torch.cuda.device_count() < world.first_gpu + size:
                raise ValueError(f"tensor_parallel_size={size} from GPU {world.first_gpu} needs "
                                 f"{world.first_gpu + size} GPUs; {torch.cuda.device_count()} visible")
            config = replace(config, device=rank_device(config.device, 0, world.first_gpu))
            self._spawn(args, join_store(world.port, world.size), world)
        elif env is not None:
            rank, started, local_rank = env      # (`world` stays None: no P/D world)
            if started != size:
                raise ValueError(f"tensor_parallel_size={size} but torchrun started {started} processes")
            config = replace(config, device=rank_device(config.device, local_rank))
            if rank != 0:   # this process is a worker: serve rank 0's steps, then leave
                run_worker(rank, size, None, args, local_rank)
                _leave_worker()
            store = None
        else:
            if config.device.type == "cuda" and torch.cuda.device_count() < size:
                raise ValueError(f"tensor_parallel_size={size} needs {size} GPUs; "
                                 f"{torch.cuda.device_count()} visible")
            config = replace(config, device=rank_device(config.device, 0))
            store = host_store(size)
            self._spawn(args, store, None)
        if config.device.type == "cpu":
            torch.set_num_threads(cpu_threads_per_rank(size if world is None else world.size))
        self.config = config
        try:
            if world is None:
                self.tp = init_tp_group(0, size, config.device, store)
            else:
                self.tp = init_world(world, 0, config.device, LINK_TIMEOUT)[0]
            _group_owner = weakref.ref(self)
            self.runner = ModelRunner(config, files.weights(), quant_method_for, self.tp)
        except Exception as e:
            time.sleep(0.2)   # a worker that failed first has its exit code by now
            if self._dead_worker() is not None or isinstance(e, RuntimeError):
                self._fail(e)
            self._stop()      # rank 0's own error (a bad checkpoint, say): raised as it is
            raise
        self.num_blocks = self.runner.num_blocks

    def _spawn(self, args, store, world: World | None) -> None:
        """Start ranks 1..N-1 and wait until each joined `store`."""
        ctx = mp.get_context("spawn")
        for r in range(1, self.size):
            p = ctx.Process(target=spawned_worker, args=(r, self.size, store.port, args, world),
                            name=f"slipstream-tp-rank{r}", daemon=True)
            p.start()
            self._procs.append(p)
        # Kill leftover workers if the engine is dropped without shutdown().
        self._finalizer = weakref.finalize(self, _kill, list(self._procs))
        self._wait_joined(store, "" if world is None else f"{world.index}/")

    def _wait_joined(self, store, prefix: str) -> None:
        keys = [f"joined/{prefix}{r}" for r in range(1, self.size)]
        deadline = time.monotonic() + COLLECTIVE_TIMEOUT_S
        while not store.check(keys):
            dead = self._dead_worker()
            if dead is not None:   # before joining: most often an import of the user's script
                self._fail(None, f"{dead} before joining (its error is printed above; a script "
                                 "that starts a tensor-parallel engine needs an `if __name__ == "
                                 "'__main__':` guard, since each worker imports it)")
            if time.monotonic() > deadline:
                self._fail(TimeoutError(f"workers did not join within {COLLECTIVE_TIMEOUT_S:.0f} s"))
            time.sleep(0.02)

    def __getattr__(self, name):   # model, backend, plan, graphs, input_batch: rank 0's
        if name in ("runner", "tp"):
            raise AttributeError(name)
        return getattr(self.runner, name)

    # ---- failure --------------------------------------------------------------

    def _dead_worker(self) -> str | None:
        for r, p in enumerate(self._procs, 1):
            if not p.is_alive():
                return f"tensor-parallel worker rank {r} (pid {p.pid}) exited with code {p.exitcode}"
        return None

    def _check_workers(self) -> None:
        if self._failed is not None:
            raise WorkerDiedError(self._failed)
        dead = self._dead_worker()
        if dead is not None:
            self._fail(None, dead)

    def _fail(self, error: BaseException | None, reason: str | None = None):
        """Stop every rank and raise WorkerDiedError (the cause named)."""
        time.sleep(0.05)   # a dying worker's exit code lands a moment after its sockets close
        reason = reason or self._dead_worker() or f"a tensor-parallel collective failed: {error}"
        self._failed = (f"{reason}; the engine stopped its other ranks and cannot run further "
                        "steps (create a new engine)")
        self._stop()
        raise WorkerDiedError(self._failed) from error

    def _stop(self) -> None:
        self._failed = self._failed or "the engine stopped"
        _kill(self._procs)
        if self.tp is not None:
            if getattr(self, "runner", None) is not None:
                self.runner.graphs = None   # graphs hold captured collectives of the group
            destroy_tp_group()
            self.tp = None
        torch.set_num_threads(self._threads)

    # ---- the ModelRunner interface ---------------------------------------------

    @contextlib.contextmanager
    def step_guard(self):
        """SIGINT held back while a step runs (main thread only), then raised: a
        step left half-way would leave the workers inside its collectives."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        caught = []
        previous = signal.signal(signal.SIGINT, lambda *_: caught.append(1))
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)
        if caught:
            raise KeyboardInterrupt

    def execute(self, sched: SchedulerOutput) -> StepHandle:
        self._check_workers()
        try:
            comm.broadcast_object(sched, self.tp.cpu_group, bounded=True)
            return self.runner.execute(sched)
        # torch.distributed's errors: gloo's "Connection closed by peer" is a plain
        # RuntimeError, NCCL's and timeouts are DistError (a RuntimeError).
        except RuntimeError as e:
            self._fail(e)

    def resolve(self, handle: StepHandle) -> StepOutput:
        try:
            if self._profiler is not None:   # times the wait inside a profile window
                return self._profiler.resolve(self.runner, handle)
            return self.runner.resolve(handle)
        except RuntimeError as e:
            self._fail(e)

    def profile(self, cmd: ProfileCommand) -> dict | None:
        """Open (op "start") or close ("stop") a profile window on every rank; on
        stop each rank writes its files under cmd.out_dir; returns rank 0's summary."""
        self.command(cmd)
        if self._profiler is None:
            self._profiler = RankProfiler(0, self.config.device)
        if cmd.op == "start":
            return self._profiler.start(cmd)
        summary = self._profiler.stop(cmd)
        try:
            torch.distributed.barrier(group=self.tp.cpu_group)   # every rank wrote its files
        except RuntimeError as e:
            self._fail(e)
        return summary

    def command(self, cmd) -> None:
        """Hand the other ranks a command in place of a step, in order with the steps:
        a ProfileCommand, or a prefill/decode K/V move (`kv_transfer.SendBlocks` /
        `ReceiveBlocks`)."""
        self._check_workers()
        try:
            comm.broadcast_object(cmd, self.tp.cpu_group, bounded=True)
        except RuntimeError as e:
            self._fail(e)

    def shutdown(self) -> None:
        """Tell the workers to stop, wait for them (briefly), release the process group."""
        if self._failed is None and self.tp is not None:
            self._failed = "the engine was shut down"
            try:
                comm.broadcast_object(None, self.tp.cpu_group, bounded=True)
            except RuntimeError:
                pass
            for p in self._procs:
                p.join(timeout=10)
            self._stop()


def _kill(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(timeout=5)


def _leave_worker() -> None:
    """End a torchrun worker once rank 0 has stopped it. Its exit handlers run and
    its output is flushed, but the interpreter's own teardown is skipped: there,
    now and then, the C++ side of torch.distributed destroyed a thread still
    running ("terminate called without an active exception", SIGABRT), which
    made torchrun report the whole run failed after its work was done."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)

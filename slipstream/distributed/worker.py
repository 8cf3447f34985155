"""A tensor-parallel worker: ranks 1..N-1, each with its own ModelRunner.

A worker holds no scheduler and no request objects. Each step it receives rank
0's `SchedulerOutput` (pickled, over the gloo cpu_group), runs the same
`execute` and `resolve` as rank 0, and so keeps the same per-request state;
the model's collectives meet rank 0's inside the forward, and rank 0's sampled
tokens arrive by broadcast. `None` in place of a step means shut down; a
`ProfileCommand` opens or closes a profile window (rank_profile.py); in a
prefill/decode pair (`parallel.World`), `SendBlocks` / `ReceiveBlocks` move this
rank's shard of a prompt's K/V to or from its peer rank (kv_transfer.py).
"""
from __future__ import annotations

import logging
import os
import sys
from dataclasses import replace

import torch

from slipstream.distributed import comm
from slipstream.distributed.kv_transfer import (LINK_TIMEOUT, ReceiveBlocks, SendBlocks,
                                                gather_blocks, kv_layout, link_of, write_blocks)
from slipstream.distributed.parallel import (World, destroy_tp_group, init_tp_group, init_world,
                                             join_store, rank_device)
from slipstream.distributed.rank_profile import ProfileCommand, RankProfiler

log = logging.getLogger("slipstream")


def cpu_threads_per_rank(size: int) -> int:
    """CPU ranks share the cores evenly (oversubscribed threads stall collectives)."""
    return max(1, (os.cpu_count() or 1) // size)


def run_worker(rank: int, size: int, store_port: int | None, args, local_rank: int,
               world: World | None = None) -> None:
    """The worker's whole life. `args`: rank 0's EngineArgs; `store_port`: rank 0's
    rendezvous (None under torchrun); `world`: the prefill/decode pair this rank's
    instance is one of (None: its own)."""
    from slipstream.config import resolve_device
    from slipstream.loader import open_model
    from slipstream.quant.selector import quant_method_for
    from slipstream.runner.model_runner import ModelRunner

    hang_dump_s = os.environ.get("SLIPSTREAM_HANG_DUMP_S")
    if hang_dump_s:   # a stuck run shows where every rank waits (faulthandler, on stderr)
        import faulthandler
        faulthandler.dump_traceback_later(float(hang_dump_s), exit=False)
    first_gpu = 0 if world is None else world.first_gpu
    device = rank_device(resolve_device(args.device), local_rank, first_gpu)
    if device.type == "cpu":
        torch.set_num_threads(cpu_threads_per_rank(size if world is None else world.size))
    store, link = None, None
    if store_port is not None:
        store = join_store(store_port, size if world is None else world.size)
        store.set(f"joined/{'' if world is None else f'{world.index}/'}{rank}", "1")
    # Join first: a failure while loading then closes this rank's sockets, and rank 0's
    # next collective fails at once instead of waiting for a rank that never comes.
    if world is None:
        tp = init_tp_group(rank, size, device, store)
    else:
        tp = init_world(world, rank, device, LINK_TIMEOUT)[0]
        link = link_of(device)
    try:
        files = open_model(args.model, args.load_format, args.seed)
        config = replace(args.create_config(str(files.path), files.config), device=device)
        torch.manual_seed(config.seed)
        runner = ModelRunner(config, files.weights(), quant_method_for(config, files), tp)
        # One step in flight, as on rank 0 with the overlapped step: step N+1 is
        # received and launched before step N's result is waited for, so this
        # rank's host work hides behind its GPU work (else every step costs host +
        # GPU time here, and rank 0 waits for it in the next collective).
        pending, profiler = None, RankProfiler(rank, device)
        sends: list = []   # K/V shards on their way to the decode peer
        while True:
            sched = comm.broadcast_object(None, tp.cpu_group)
            if sched is None:
                break
            if isinstance(sched, (SendBlocks, ReceiveBlocks)):   # a prompt's K/V moves
                if pending is not None:   # after the steps before it
                    profiler.resolve(runner, pending)
                    pending = None
                sends = [s for s in sends if not s[0].is_completed()]
                sends += move_shard(runner, link, sched)
                continue
            if isinstance(sched, ProfileCommand):   # rank 0 opens or closes a window
                if pending is not None:
                    profiler.resolve(runner, pending)
                    pending = None
                if sched.op == "start":
                    profiler.start(sched)
                else:
                    profiler.stop(sched)
                    torch.distributed.barrier(group=tp.cpu_group)   # files written
                continue
            if getattr(sched, "spec_drafts", None) and pending is not None:
                # Drafts follow their root token, which the step before sampled: that
                # step's result first (rank 0 collected it before drafting, too).
                profiler.resolve(runner, pending)
                pending = None
            handle = runner.execute(sched)
            if pending is not None:
                profiler.resolve(runner, pending)
            pending = handle
        if pending is not None:
            runner.resolve(pending)
    except RuntimeError as e:   # rank 0 went away: nothing left to serve
        print(f"slipstream tensor-parallel worker rank {rank}: stopping: {e}", file=sys.stderr)
        sys.exit(1)
    finally:
        runner = None   # its CUDA graphs hold captured collectives of the group
        destroy_tp_group()


def move_shard(runner, link, cmd) -> list:
    """Carry out a SendBlocks (returns the pending send) or a ReceiveBlocks on this rank."""
    if isinstance(cmd, SendBlocks):
        if not cmd.block_ids:
            return []
        kv = gather_blocks(runner, cmd.block_ids)
        if kv.is_cuda:   # gathered before NCCL reads it on its own stream
            torch.cuda.current_stream(kv.device).synchronize()
        return [link.send_tensor(kv, wait=False)]
    shape, dtype = kv_layout(runner)
    blocks = link.recv_tensor((*shape[:2], cmd.n, *shape[2:]), dtype)
    write_blocks(runner, blocks, cmd.src, cmd.dst)
    return []


def follow_parent() -> None:
    """For a process rank 0 spawned: Ctrl-C (SIGINT to the terminal's process group)
    is rank 0's to handle, which then stops its helpers; and the process ends soon
    after its parent process does (a watch on the parent pid: no helper outlives a
    server killed while it loads). Not a parent-death signal, which follows the
    spawning thread rather than the process."""
    import multiprocessing
    import signal
    import threading
    import time
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch():
        while os.getppid() == parent.pid:
            time.sleep(0.5)
        os._exit(1)     # reparented: the parent is gone
    threading.Thread(target=watch, name="slipstream-parent-watch", daemon=True).start()


def spawned_worker(rank: int, size: int, store_port: int, args, world: World | None = None) -> None:
    """Entry point of a worker that rank 0 started (torch.multiprocessing spawn)."""
    follow_parent()
    run_worker(rank, size, store_port, args, local_rank=rank, world=world)

"""Tensor-parallel process groups: who is rank r of N, and how the ranks meet.

The engine's process is rank 0: it runs the scheduler and drives ranks
1..N-1, which it starts itself with torch.multiprocessing (spawn), or which
torchrun started alongside it (when the environment carries torchrun's
RANK / WORLD_SIZE / MASTER_ADDR). Every rank holds one `TPGroup` with two
process groups over the same ranks:

  device_group  the model's collectives (all-reduce, all-gather): NCCL on CUDA,
                gloo on the CPU, with a timeout so a stuck peer fails a step
                instead of hanging it;
  cpu_group     gloo, for the step data rank 0 broadcasts each step (pickled)
                and small host integers. Its timeout is long: a worker waits
                there for the next step however long the engine stays idle.

A peer that dies closes its sockets, so the survivors' next collective fails
at once; rank 0 also checks its workers' processes before each step.

An instance may also be one of two in a larger world (`World`: a prefill/decode
pair, each instance tensor-parallel over the same number of ranks). Then every
process of both instances joins one torch.distributed world, and `init_world`
makes the groups of both instances and the links between them, in the same
order on every rank (torch.distributed requires that).
"""
from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist

from slipstream.config import ModelConfig

log = logging.getLogger("slipstream")

# A collective that waits longer than this on a live peer fails the step.
COLLECTIVE_TIMEOUT_S = 120.0
# Workers wait this long for rank 0's next step (an idle engine sends nothing).
IDLE_TIMEOUT = timedelta(days=30)


@dataclass(frozen=True)
class TPGroup:
    rank: int
    size: int
    device_group: object   # torch.distributed ProcessGroup
    cpu_group: object      # torch.distributed ProcessGroup (gloo)


def check_shardable(mc: ModelConfig, tp_size: int) -> None:
    """Raise ValueError (naming tensor_parallel_size) unless `mc` splits over `tp_size` ranks.

    Query heads and the MLP's intermediate features split evenly; KV heads split
    evenly when there are at least as many as ranks, else each is replicated on
    tp_size / num_kv_heads ranks (which must be whole)."""
    if tp_size < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {tp_size}")
    if tp_size == 1:
        return
    h, kv = mc.num_attention_heads, mc.num_key_value_heads
    problems = []
    if h % tp_size:
        problems.append(f"{h} attention heads")
    if kv % tp_size and tp_size % kv:
        problems.append(f"{kv} KV heads (neither split evenly nor replicated evenly)")
    if mc.intermediate_size % tp_size:
        problems.append(f"an intermediate size of {mc.intermediate_size}")
    if problems:
        raise ValueError(f"tensor_parallel_size={tp_size} does not divide the model's "
                         f"{' and '.join(problems)}; choose a size that does")


def kv_heads_of_rank(num_kv_heads: int, rank: int, size: int) -> tuple[int, int]:
    """(first KV head, count) held by `rank`: a split when num_kv_heads >= size,
    else one head replicated on size / num_kv_heads consecutive ranks."""
    return rank * num_kv_heads // size, max(1, num_kv_heads // size)


def rank_shape(mc: ModelConfig, size: int) -> ModelConfig:
    """The per-rank shape of `mc` (heads, KV heads, intermediate features):
    what one rank's KV cache and working memory are sized for."""
    if size == 1:
        return mc
    return replace(mc, num_attention_heads=mc.num_attention_heads // size,
                   num_key_value_heads=kv_heads_of_rank(mc.num_key_value_heads, 0, size)[1],
                   intermediate_size=mc.intermediate_size // size)


def torchrun_rank() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when torchrun started this process, else None."""
    env = os.environ
    if not all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return None
    return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", env["RANK"]))


def rank_device(device: torch.device, local_rank: int, first_gpu: int = 0) -> torch.device:
    """Rank r drives GPU first_gpu + r of its host; CPU ranks share the CPU."""
    return torch.device("cuda", first_gpu + local_rank) if device.type == "cuda" else device


def host_store(size: int) -> dist.TCPStore:
    """The rendezvous rank 0 hosts for the workers it starts (on a free port)."""
    return dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))


def join_store(port: int, size: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, size, is_master=False,
                         timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))


def init_tp_group(rank: int, size: int, device: torch.device,
                  store: dist.Store | None = None) -> TPGroup:
    """Join the `size` ranks through `store` (None: torchrun's env://). Blocks
    until all have joined (at most COLLECTIVE_TIMEOUT_S)."""
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process: another "
                           "tensor-parallel engine is running here; shut it down first "
                           "(Engine.shutdown())")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    kw = {"store": store} if store is not None else {"init_method": "env://"}
    dist.init_process_group(backend, rank=rank, world_size=size,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S), **kw)
    cpu_group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return TPGroup(rank, size, dist.group.WORLD, cpu_group)


@dataclass(frozen=True)
class World:
    """Two instances in one torch.distributed world: instance i holds the global
    ranks [i * tp, (i + 1) * tp), and rank r of one is linked to rank r of the
    other (`PairLink`). `port`: the rendezvous store; `first_gpu`: the GPU of
    this instance's rank 0 (its ranks take the GPUs after it)."""
    port: int
    tp: int
    index: int
    first_gpu: int = 0
    instances: int = 2

    @property
    def size(self) -> int:
        return self.instances * self.tp

    def global_rank(self, local_rank: int) -> int:
        return self.index * self.tp + local_rank


@dataclass(frozen=True)
class PairLink:
    """Rank r of one instance and rank r of the other: `data` carries tensors
    (NCCL between GPUs, gloo on the CPU); on the instances' ranks 0 two gloo
    groups carry small messages, one a direction (`to` [i]: towards instance i),
    so each side can receive on a thread while it sends on another."""
    index: int                 # this end's instance
    local_rank: int
    peer: int                  # the other end's global rank
    data: object
    to: tuple = ()             # ranks 0 only: (towards instance 0, towards instance 1)


_LINK: PairLink | None = None   # this process's end, once init_world made it


def init_world(world: World, local_rank: int, device: torch.device,
               link_timeout: timedelta) -> tuple[TPGroup | None, PairLink]:
    """Join `world` (blocks until every rank of both instances joined) and make,
    in one order on every rank: each instance's device and cpu groups (when it
    has more than one rank), then the tensor link of each rank pair, then the
    two message groups of the ranks 0. Returns this rank's TPGroup (None for a
    one-rank instance) and its end of the link (also kept for `world_link`)."""
    global _LINK
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process; shut "
                           "the other engine down first (Engine.shutdown())")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    me = world.global_rank(local_rank)
    dist.init_process_group(backend, store=join_store(world.port, world.size), rank=me,
                            world_size=world.size, timeout=link_timeout)
    tp = None
    for i in range(world.instances):
        if world.tp == 1:
            break
        ranks = list(range(i * world.tp, (i + 1) * world.tp))
        device_group = dist.new_group(ranks, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        cpu_group = dist.new_group(ranks, backend="gloo", timeout=IDLE_TIMEOUT)
        if i == world.index:
            tp = TPGroup(local_rank, world.tp, device_group, cpu_group)
    data = [dist.new_group([r, world.tp + r]) for r in range(world.tp)]
    to = tuple(dist.new_group([0, world.tp], backend="gloo", timeout=IDLE_TIMEOUT)
               for _ in range(world.instances))
    peer = (1 - world.index) * world.tp + local_rank
    _LINK = PairLink(world.index, local_rank, peer, data[local_rank],
                     to if local_rank == 0 else ())
    return tp, _LINK


def world_link() -> PairLink:
    """This process's end of the link that init_world made."""
    if _LINK is None or not dist.is_initialized():
        raise RuntimeError("no prefill/decode link in this process")
    return _LINK


def destroy_tp_group(timeout_s: float = 10.0) -> None:
    """Release the process group, waiting at most `timeout_s`: NCCL's teardown can
    block for good once a peer is gone (seen on 2x H200 after CUDA graphs had
    captured its all-reduces), and shutting down must never hang."""
    global _LINK
    _LINK = None
    if not dist.is_initialized():
        return
    done = threading.Event()

    def destroy():
        try:
            dist.destroy_process_group()
        finally:
            done.set()

    threading.Thread(target=destroy, name="slipstream-destroy-pg", daemon=True).start()
    if not done.wait(timeout_s):
        log.warning("torch.distributed did not release the process group within %.0f s; "
                    "left behind (this process cannot start another tensor-parallel engine)",
                    timeout_s)

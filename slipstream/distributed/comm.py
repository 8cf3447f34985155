"""Collectives over torch.distributed for tensor parallelism.

Thin wrappers that name what the model needs: the all-reduce after a
row-parallel layer, the all-gather of vocabulary-parallel logits, and the
broadcast of rank 0's step data (pickled objects) and sampled token ids. Each
takes the process group explicitly, and a source rank is a rank in that group
(the group is the whole world only for an instance on its own; in a
prefill/decode pair the decode instance's rank 0 is not global rank 0).
"""
from __future__ import annotations

import pickle
from datetime import timedelta

import torch
import torch.distributed as dist


# group -> its symmetric-memory all-reduce for small tensors (symm_all_reduce.py)
_SMALL_ALL_REDUCE: dict[int, object] = {}


def use_small_all_reduce(group, fn) -> None:
    """Route `group`'s all-reduces that `fn.fits` to `fn` (None: NCCL only)."""
    if fn is None:
        _SMALL_ALL_REDUCE.pop(id(group), None)
    else:
        _SMALL_ALL_REDUCE[id(group)] = fn


def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """Sum `x` over the ranks of `group`, in place; returns `x`."""
    small = _SMALL_ALL_REDUCE.get(id(group))
    if small is not None and small.fits(x):
        return small(x)
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


def all_reduce_min(value: int, group) -> int:
    """The smallest of each rank's `value` (an int, on the CPU group)."""
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())


def all_gather(x: torch.Tensor, group, world_size: int) -> torch.Tensor:
    """x: [..., k] on every rank -> [..., world_size * k], rank r's block at r * k."""
    parts = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def broadcast(x: torch.Tensor, group, src: int = 0) -> torch.Tensor:
    """Overwrite `x` on every rank with rank `src`'s (in place); returns `x`."""
    dist.broadcast(x, group=group, group_src=src)
    return x


# The source of a broadcast_object waits this long for a payload that fits the
# sockets' buffers (it needs no reader to land), then fails: a peer that died can
# leave gloo's send waiting for good (seen once in CI while a killed worker's
# sockets closed). Larger payloads wait for a busy reader up to LARGE_SEND_S.
SMALL_SEND_S = 5.0
SMALL_SEND_BYTES = 1 << 20
LARGE_SEND_S = 120.0


def broadcast_object(obj: object, group, src: int = 0, bounded: bool = False) -> object:
    """Rank `src`'s picklable `obj` on every rank (other ranks pass anything): its
    pickled size, then its bytes. bounded: the source fails (RuntimeError) instead of
    waiting past SMALL_SEND_S / LARGE_SEND_S; receivers wait as long as the group's
    timeout allows (an idle worker waits for the next step)."""
    if dist.get_rank(group) == src:
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        limit = SMALL_SEND_S if data.numel() <= SMALL_SEND_BYTES else LARGE_SEND_S
        for t in (size, data):
            work = dist.broadcast(t, group=group, group_src=src, async_op=True)
            work.wait(timedelta(seconds=limit)) if bounded else work.wait()
        return obj
    size = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(size, group=group, group_src=src)
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(data, group=group, group_src=src)
    return pickle.loads(data.numpy().tobytes())

"""Collectives over torch.distributed for tensor parallelism.

Thin wrappers that name what the model needs: the all-reduce after a
row-parallel layer, the all-gather of vocabulary-parallel logits, and the
broadcast of rank 0's step data (pickled objects) and sampled token ids. Each
takes the process group explicitly, and a source rank is a rank in that group
(the group is the whole world only for an instance on its own; in a
prefill/decode pair the decode instance's rank 0 is not global rank 0).
"""
from __future__ import annotations

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


def broadcast_object(obj: object, group, src: int = 0) -> object:
    """Rank `src`'s picklable `obj` on every rank (other ranks pass anything)."""
    box = [obj]
    dist.broadcast_object_list(box, group=group, group_src=src)
    return box[0]

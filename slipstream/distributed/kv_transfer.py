"""Moving a prompt's KV blocks between two engines over torch.distributed.

Two instances (a prefill one and a decode one, each its own processes: one, or
one a tensor-parallel rank) join one process group (`parallel.World`): rank r
of one instance is linked to rank r of the other, NCCL between GPUs and gloo
on the CPU for the KV tensors, and the two ranks 0 have two gloo groups for
small pickled messages, one per direction (so each side may receive on a
thread while it sends on another).

What moves is the K/V of a prompt's full blocks, in the engine's own KV layout
(`runner.kv_cache`: [layers, 2, num_blocks, block_size, kv_heads, head_dim]),
gathered into one contiguous tensor [layers, 2, n, block_size, kv_heads, head_dim]
and sent point-to-point. The receiver writes it into free blocks of its pool
and registers them in its prefix cache under the prompt's chained block hashes
(`cache/prefix_cache.py`): the request then enters the receiving engine as a
plain request whose prompt is a prefix-cache hit. So the scheduler and runner
need no new path, and a block evicted before the request is admitted is simply
recomputed (the output never changes, only the work).

Under tensor parallelism each rank holds the K/V of its own KV heads, so each
rank pair moves its shard: the ranks 0 exchange the messages and their shards,
then tell their other ranks (`SendBlocks` / `ReceiveBlocks`, through the
step-data channel) which blocks to send, or to receive and where to write.

At most (prompt_len - 1) // block_size blocks move: the engine always computes
a prompt's last token itself (its logits give the first output token), so the
receiver computes the tail (< block_size + 1 tokens) and samples.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from slipstream.cache.prefix_cache import BlockHasher
from slipstream.distributed.parallel import PairLink, World, destroy_tp_group, init_world, world_link

PREFILL_RANK, DECODE_RANK = 0, 1
# A transfer or message that waits longer than this on a live peer fails.
LINK_TIMEOUT = timedelta(seconds=60)


@dataclass
class Transfer:
    """One prompt's K/V move, as the decode side saw it (`PDEngine.transfers`)."""
    request_id: str
    prompt_tokens: int
    tokens: int            # tokens whose K/V moved (full blocks)
    bytes: int
    recv_s: float          # from posting the receive (the data is gathered by then) to its landing
    import_s: float = 0.0  # writing into the pool
    imported_tokens: int = 0


@dataclass(frozen=True)
class KVLink:
    """This process's end of the prefill/decode link (`parallel.PairLink`): rank r of
    one instance with rank r of the other. Messages go between the ranks 0 only."""
    pair: PairLink
    device: torch.device

    @property
    def rank(self) -> int:
        """PREFILL_RANK or DECODE_RANK: the instance this end belongs to."""
        return self.pair.index

    def send_message(self, obj: object, wait: bool = True) -> list:
        """Send a picklable `obj`. wait=False returns at once with the pending sends
        (keep them, tensors included, until `done(...)`): a peer that stopped
        reading then cannot block the sender."""
        group, peer = self.pair.to[1 - self.rank], self.pair.peer
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        if wait:
            dist.send(size, peer, group=group)
            dist.send(data, peer, group=group)
            return []
        return [(dist.isend(size, peer, group=group), size),
                (dist.isend(data, peer, group=group), data)]

    def recv_message(self) -> object:
        """Blocks until the peer sends (raises RuntimeError once the peer is gone)."""
        group = self.pair.to[self.rank]
        size = torch.zeros(1, dtype=torch.int64)
        dist.recv(size, self.pair.peer, group=group)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.recv(data, self.pair.peer, group=group)
        return pickle.loads(data.numpy().tobytes())

    def send_tensor(self, x: torch.Tensor, wait: bool = True):
        """Send `x` to the peer rank; wait=False returns (work, tensor): keep both
        until the work is done."""
        x = x.contiguous()
        if wait:
            dist.send(x, self.pair.peer, group=self.pair.data)
            return None
        return dist.isend(x, self.pair.peer, group=self.pair.data), x

    def recv_tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        x = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(x, self.pair.peer, group=self.pair.data)
        if x.device.type == "cuda":
            torch.cuda.current_stream(x.device).synchronize()
        return x


def open_link(world: World, device: torch.device, local_rank: int = 0) -> KVLink:
    """Join `world` as `local_rank` of an instance without tensor parallelism
    (blocks until every rank joined); an instance with it joins through its
    executor and takes its end with `link_of`."""
    init_world(world, local_rank, device, LINK_TIMEOUT)
    return link_of(device)


def link_of(device: torch.device) -> KVLink:
    """This process's end of the link its world made."""
    return KVLink(world_link(), device)


def close_link() -> None:
    destroy_tp_group()


def prompt_block_hashes(prompt_ids: list[int], block_size: int) -> list[bytes]:
    """The chained hashes of the prompt blocks that may move: full blocks, and
    never the one holding the last token (the receiver computes that)."""
    hashes: list[bytes] = []
    BlockHasher(block_size).extend(hashes, prompt_ids)
    return hashes[:(len(prompt_ids) - 1) // block_size]


@dataclass(frozen=True)
class SendBlocks:
    """To a prefill instance's other ranks: send your shard of these blocks' K/V to
    your decode peer (what the rank 0 just sent to its own)."""
    block_ids: list[int]


@dataclass(frozen=True)
class ReceiveBlocks:
    """To a decode instance's other ranks: receive a shard of `n` blocks from your
    prefill peer, and write its blocks at positions `src` into blocks `dst` of the
    pool (none: a dropped request's K/V, received and discarded)."""
    n: int
    src: list[int]
    dst: list[int]


def kv_layout(runner) -> tuple[tuple[int, ...], torch.dtype]:
    """(shape of one block's K/V on this rank: [layers, 2, block_size, kv_heads,
    head_dim], dtype). A quantized cache (int8 / fp8 codes with a scale per token
    and head) moves as bytes, each (token, head) row its codes then its fp32
    scale: [..., head_dim * code bytes + 4] uint8."""
    kv, scales = runner.kv_cache, runner.kv_scales
    if scales is None:
        return (kv.shape[0], kv.shape[1], *kv.shape[3:]), kv.dtype
    return (kv.shape[0], kv.shape[1], *kv.shape[3:-1], kv.shape[-1] * kv.element_size() + 4), \
        torch.uint8


def cached_block_ids(engine, prompt_ids: list[int]) -> list[int]:
    """The pool's blocks holding the cached leading blocks of `prompt_ids` (maybe none)."""
    pool = engine.kv.pool
    ids = []
    for h in prompt_block_hashes(prompt_ids, engine.kv.block_size):
        block = pool.lookup(h)
        if block is None:
            break
        ids.append(block.block_id)
    return ids


def gather_blocks(runner, block_ids: list[int]) -> torch.Tensor:
    """This rank's K/V of `block_ids`: [layers, 2, n, block_size, kv_heads, head_dim]
    (the bytes of `kv_layout` for a quantized cache), a new tensor on its device."""
    kv, scales = runner.kv_cache, runner.kv_scales
    index = torch.tensor(block_ids, dtype=torch.int64, device=kv.device)
    if scales is None:
        return kv.index_select(2, index)
    codes = kv.view(torch.uint8).index_select(2, index)              # [..., d * code bytes]
    s = scales.index_select(2, index).unsqueeze(-1).view(torch.uint8)  # [..., 4]
    return torch.cat([codes, s], dim=-1)


def write_blocks(runner, blocks: torch.Tensor, src: list[int], dst: list[int]) -> None:
    """Write blocks `src` of received K/V (`gather_blocks`' layout) into the pool's
    blocks `dst` on this rank."""
    if not dst:
        return
    kv, scales = runner.kv_cache, runner.kv_scales
    if src != list(range(blocks.shape[2])):   # some were cached already: skip those
        blocks = blocks.index_select(2, torch.tensor(src, dtype=torch.int64, device=blocks.device))
    blocks = blocks.to(kv.device)
    index = torch.tensor(dst, dtype=torch.int64, device=kv.device)
    if scales is None:
        kv.index_copy_(2, index, blocks)
    else:   # codes then each row's fp32 scale, as bytes (kv_layout)
        cb = kv.shape[-1] * kv.element_size()
        kv.view(torch.uint8).index_copy_(2, index, blocks[..., :cb].contiguous())
        scales.index_copy_(2, index, blocks[..., cb:].contiguous().view(torch.float32).squeeze(-1))


def export_blocks(engine, prompt_ids: list[int]) -> torch.Tensor:
    """The K/V of the cached leading blocks of `prompt_ids` in `engine`'s pool.

    Call it once the prompt was computed (its blocks are cached, or still held):
    returns [layers, 2, n, block_size, kv_heads, head_dim] for the n leading
    blocks found (n may be 0), a new tensor on the engine's device."""
    return gather_blocks(engine.runner, cached_block_ids(engine, prompt_ids))


def import_blocks(engine, prompt_ids: list[int], blocks: torch.Tensor) -> ReceiveBlocks:
    """Write received K/V (`blocks`: [layers, 2, n, block_size, kv_heads, head_dim])
    into `engine`'s pool as prefix-cache blocks of `prompt_ids`. Blocks already
    cached are kept as they are, and blocks the pool has no room for are left to
    be recomputed. Returns where the blocks went (`ReceiveBlocks`: the other ranks
    of a tensor-parallel instance write their shards the same way); `placed`
    tells how many leading blocks are now cached.

    The new blocks end up free (reference count 0) at the back of the LRU queue,
    where the next `add_request` of the prompt finds them."""
    pool = engine.kv.pool
    if blocks.is_cuda:   # received on another stream: keep its memory until the copy below ran
        blocks.record_stream(torch.cuda.current_stream(blocks.device))
    hashes = prompt_block_hashes(prompt_ids, engine.kv.block_size)[:blocks.shape[2]]
    found = []          # (position, cached block)
    missing = []        # positions to write
    for i, h in enumerate(hashes):
        block = pool.lookup(h)
        (found.append((i, block)) if block is not None else missing.append(i))
    held = [b for _, b in found]
    pool.touch(held)   # out of the free queue: allocating below must not evict them
    take = min(len(missing), pool.num_free_blocks)
    missing = missing[:take]
    new = pool.allocate(take)
    where = ReceiveBlocks(blocks.shape[2], missing, [b.block_id for b in new])
    write_blocks(engine.runner, blocks, where.src, where.dst)
    for i, b in zip(missing, new):
        pool.cache_block(b, hashes[i])
    # Free in reverse prompt order: the prompt's head is the last to be evicted.
    by_pos = sorted([(i, b) for i, b in found] + list(zip(missing, new)), key=lambda t: t[0])
    pool.free([b for _, b in reversed(by_pos)])
    return where


def placed(engine, prompt_ids: list[int], n: int) -> int:
    """How many of the first `n` moved blocks of `prompt_ids` are cached now."""
    hashes = prompt_block_hashes(prompt_ids, engine.kv.block_size)[:n]
    k = 0
    while k < len(hashes) and engine.kv.pool.lookup(hashes[k]) is not None:
        k += 1
    return k

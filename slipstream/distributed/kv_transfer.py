"""Moving a prompt's KV blocks between two engines over torch.distributed.

Two instances (a prefill one and a decode one, each its own process) join a
2-rank process group: NCCL between GPUs, gloo on the CPU, for the KV tensors,
and two gloo groups for small pickled messages, one per direction (so each side
may receive on a thread while it sends on another).

What moves is the K/V of a prompt's full blocks, in the engine's own KV layout
(`runner.kv_cache`: [layers, 2, num_blocks, block_size, kv_heads, head_dim]),
gathered into one contiguous tensor [layers, 2, n, block_size, kv_heads, head_dim]
and sent point-to-point. The receiver writes it into free blocks of its pool
and registers them in its prefix cache under the prompt's chained block hashes
(`cache/prefix_cache.py`): the request then enters the receiving engine as a
plain request whose prompt is a prefix-cache hit. So the scheduler and runner
need no new path, and a block evicted before the request is admitted is simply
recomputed (the output never changes, only the work).

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
    """This process's end of the prefill/decode link."""
    rank: int
    device: torch.device
    to_prefill: object    # gloo group: messages decode -> prefill
    to_decode: object     # gloo group: messages prefill -> decode

    @property
    def peer(self) -> int:
        return 1 - self.rank

    def send_message(self, obj: object, wait: bool = True) -> list:
        """Send a picklable `obj`. wait=False returns at once with the pending sends
        (keep them, tensors included, until `done(...)`): a peer that stopped
        reading then cannot block the sender."""
        group = self.to_decode if self.rank == PREFILL_RANK else self.to_prefill
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        if wait:
            dist.send(size, self.peer, group=group)
            dist.send(data, self.peer, group=group)
            return []
        return [(dist.isend(size, self.peer, group=group), size),
                (dist.isend(data, self.peer, group=group), data)]

    def recv_message(self) -> object:
        """Blocks until the peer sends (raises RuntimeError once the peer is gone)."""
        group = self.to_prefill if self.rank == PREFILL_RANK else self.to_decode
        size = torch.zeros(1, dtype=torch.int64)
        dist.recv(size, self.peer, group=group)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.recv(data, self.peer, group=group)
        return pickle.loads(data.numpy().tobytes())

    def send_tensor(self, x: torch.Tensor) -> None:
        dist.send(x.contiguous(), self.peer)

    def recv_tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        x = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(x, self.peer)
        if x.device.type == "cuda":
            torch.cuda.current_stream(x.device).synchronize()
        return x


def open_link(rank: int, device: torch.device, store: dist.Store) -> KVLink:
    """Join the 2-rank group through `store` (blocks until both ends joined)."""
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process; a "
                           "prefill/decode instance runs with tensor_parallel_size=1")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=2, timeout=LINK_TIMEOUT)
    to_prefill = dist.new_group(backend="gloo", timeout=timedelta(days=30))
    to_decode = dist.new_group(backend="gloo", timeout=timedelta(days=30))
    return KVLink(rank, device, to_prefill, to_decode)


def close_link() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def prompt_block_hashes(prompt_ids: list[int], block_size: int) -> list[bytes]:
    """The chained hashes of the prompt blocks that may move: full blocks, and
    never the one holding the last token (the receiver computes that)."""
    hashes: list[bytes] = []
    BlockHasher(block_size).extend(hashes, prompt_ids)
    return hashes[:(len(prompt_ids) - 1) // block_size]


def kv_layout(engine) -> tuple[tuple[int, ...], torch.dtype]:
    """(shape of one block's K/V: [layers, 2, block_size, kv_heads, head_dim], dtype).
    A quantized cache (int8 / fp8 codes with a scale per token and head) moves as
    bytes, each (token, head) row its codes then its fp32 scale: [..., head_dim *
    code bytes + 4] uint8."""
    kv, scales = engine.runner.kv_cache, engine.runner.kv_scales
    if scales is None:
        return (kv.shape[0], kv.shape[1], *kv.shape[3:]), kv.dtype
    return (kv.shape[0], kv.shape[1], *kv.shape[3:-1], kv.shape[-1] * kv.element_size() + 4), \
        torch.uint8


def export_blocks(engine, prompt_ids: list[int]) -> torch.Tensor:
    """The K/V of the cached leading blocks of `prompt_ids` in `engine`'s pool.

    Call it once the prompt was computed (its blocks are cached, or still held):
    returns [layers, 2, n, block_size, kv_heads, head_dim] for the n leading
    blocks found (n may be 0), a new tensor on the engine's device."""
    pool = engine.kv.pool
    ids = []
    for h in prompt_block_hashes(prompt_ids, engine.kv.block_size):
        block = pool.lookup(h)
        if block is None:
            break
        ids.append(block.block_id)
    kv, scales = engine.runner.kv_cache, engine.runner.kv_scales
    index = torch.tensor(ids, dtype=torch.int64, device=kv.device)
    if scales is None:
        return kv.index_select(2, index)
    codes = kv.view(torch.uint8).index_select(2, index)              # [..., d * code bytes]
    s = scales.index_select(2, index).unsqueeze(-1).view(torch.uint8)  # [..., 4]
    return torch.cat([codes, s], dim=-1)


def import_blocks(engine, prompt_ids: list[int], blocks: torch.Tensor) -> int:
    """Write received K/V (`blocks`: [layers, 2, n, block_size, kv_heads, head_dim])
    into `engine`'s pool as prefix-cache blocks of `prompt_ids`. Blocks already
    cached are kept as they are. Returns the number of leading blocks now cached
    (fewer than n when the pool has too few free blocks; the rest is recomputed).

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
    if new:
        kv, scales = engine.runner.kv_cache, engine.runner.kv_scales
        dst = torch.tensor([b.block_id for b in new], dtype=torch.int64, device=kv.device)
        if missing != list(range(blocks.shape[2])):   # some were cached already: skip those
            src = torch.tensor(missing, dtype=torch.int64, device=blocks.device)
            blocks = blocks.index_select(2, src)
        blocks = blocks.to(kv.device)
        if scales is None:
            kv.index_copy_(2, dst, blocks)
        else:   # codes then each row's fp32 scale, as bytes (kv_layout)
            cb = kv.shape[-1] * kv.element_size()
            kv.view(torch.uint8).index_copy_(2, dst, blocks[..., :cb].contiguous())
            s = blocks[..., cb:].contiguous().view(torch.float32).squeeze(-1)
            scales.index_copy_(2, dst, s)
        for i, b in zip(missing, new):
            pool.cache_block(b, hashes[i])
    # Free in reverse prompt order: the prompt's head is the last to be evicted.
    by_pos = sorted([(i, b) for i, b in found] + list(zip(missing, new)), key=lambda t: t[0])
    pool.free([b for _, b in reversed(by_pos)])
    n = 0
    while n < len(hashes) and pool.lookup(hashes[n]) is not None:
        n += 1
    return n

"""Per-request block tables over the shared block pool, with prefix reuse."""
from __future__ import annotations

from slipstream.cache.block_pool import BlockPool, KVBlock
from slipstream.engine.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self._blocks: dict[str, list[KVBlock]] = {}
        self._num_cached: dict[str, int] = {}  # leading blocks already registered in the cache

    @property
    def enable_caching(self) -> bool:
        return self.pool.enable_caching

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._blocks.get(request_id, ())]

    def get_computed_blocks(self, request: Request) -> list[KVBlock]:
        """The longest run of cached blocks that prefix the request. At least
        the last token is always left to compute, since its logits are needed."""
        if not self.enable_caching or request.wants_prompt_logprobs:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for h in request.block_hashes[:max_blocks]:
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[KVBlock] = ()) -> bool:
        """Make room for `num_new_tokens` more tokens after the request's
        computed ones (and after `computed_blocks`, prefix hits not yet owned).
        Returns False, changing nothing, when the pool is short."""
        blocks = self._blocks.setdefault(request.request_id, [])
        num_total = (request.num_computed_tokens + num_new_tokens
                     + len(computed_blocks) * self.block_size)
        need = -(-num_total // self.block_size) - len(blocks) - len(computed_blocks)
        # Hits that sit in the free queue stop being free once touched.
        reclaim = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if need > self.pool.num_free_blocks - reclaim:
            if not blocks:
                del self._blocks[request.request_id]
            return False
        self.pool.touch(list(computed_blocks))
        blocks.extend(computed_blocks)
        if need > 0:
            blocks.extend(self.pool.allocate(need))
        self._cache_full_blocks(request, blocks, num_total)
        return True

    def _cache_full_blocks(self, request: Request, blocks: list[KVBlock], num_tokens: int) -> None:
        # Blocks full after this step are registered now: their K/V are written
        # by this step's forward, before any later step can read them.
        if not self.enable_caching:
            return
        start = self._num_cached.get(request.request_id, 0)
        end = min(num_tokens // self.block_size, len(request.block_hashes))
        for i in range(start, end):
            self.pool.cache_block(blocks[i], request.block_hashes[i])
        self._num_cached[request.request_id] = max(start, end)

    def free(self, request: Request) -> None:
        blocks = self._blocks.pop(request.request_id, [])
        self._num_cached.pop(request.request_id, None)
        self.pool.free(list(reversed(blocks)))

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

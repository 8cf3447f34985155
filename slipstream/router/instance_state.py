"""What an engine instance tells a KV-aware router: its cached blocks and its load.

`slipstream serve` answers `GET /v1/cache/state` with `instance_state(...)`:
the chained hashes of the KV blocks its prefix cache holds (hex; equal hashes
mean equal K/V, see cache/prefix_cache.py), the block size they were cut with,
and the queue lengths. The router hashes each prompt the same way and sends it
to the instance holding its longest cached prefix.

The engine thread changes the cache while this runs on the server's loop: the
hashes are copied in one C-level call (`BlockPool.cached_hashes`), retried if
the dict changed size meanwhile.
"""
from __future__ import annotations


def cached_block_hashes(engine) -> list[bytes]:
    pool = engine.kv.pool
    for _ in range(5):
        try:
            return pool.cached_hashes()
        except RuntimeError:   # changed size during the copy
            continue
    return []


def instance_state(engine, stats=None, in_flight: int = 0) -> dict:
    """stats: the server's EngineStats snapshot (waiting, running, kv usage), if any."""
    cc = engine.config.cache
    hashes = cached_block_hashes(engine) if cc.enable_prefix_caching else []
    state = {"block_size": cc.block_size, "prefix_caching": cc.enable_prefix_caching,
             "cached_block_hashes": [h.hex() for h in hashes], "in_flight": in_flight}
    if stats is not None:
        state.update(waiting=stats.waiting, running=stats.running, kv_usage=stats.kv_usage)
    return state

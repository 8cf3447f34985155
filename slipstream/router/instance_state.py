"""What an engine instance tells a KV-aware router: its cached blocks and its load.

`slipstream serve` answers `GET /v1/cache/state` with `instance_state(...)`:
the chained hashes of the KV blocks its prefix cache holds (equal hashes mean
equal K/V, see cache/prefix_cache.py), the block size they were cut with, and
the queue lengths. The router hashes each prompt the same way and sends it to
the instance holding its longest cached prefix.

A GPU's pool holds 10^5 blocks and more, polled twice a second, so the hashes
go compactly: each cut to its first HASH_BYTES bytes, all of them concatenated
in one base64 string (about 11 bytes a block, encoded at C speed). A collision
of two truncated hashes can only misdirect a request, never change its output:
the instance itself matches full hashes.

The engine thread changes the cache while this runs on the server's loop: the
hashes are copied in one C-level call (`BlockPool.cached_hashes`), retried if
the dict changed size meanwhile.
"""
from __future__ import annotations

import base64

HASH_BYTES = 8


def cached_block_hashes(engine) -> list[bytes]:
    pool = engine.kv.pool
    for _ in range(5):
        try:
            return pool.cached_hashes()
        except RuntimeError:   # changed size during the copy
            continue
    return []


def pack_hashes(hashes: list[bytes]) -> str:
    return base64.b64encode(b"".join(h[:HASH_BYTES] for h in hashes)).decode()


def unpack_hashes(packed: str, hash_bytes: int = HASH_BYTES) -> set[bytes]:
    raw = base64.b64decode(packed)
    return {raw[i:i + hash_bytes] for i in range(0, len(raw), hash_bytes)}


def instance_state(engine, stats=None, in_flight: int = 0) -> dict:
    """stats: the server's EngineStats snapshot (waiting, running, kv usage), if any."""
    cc = engine.config.cache
    hashes = cached_block_hashes(engine) if cc.enable_prefix_caching else []
    state = {"block_size": cc.block_size, "prefix_caching": cc.enable_prefix_caching,
             "hash_bytes": HASH_BYTES, "num_cached_blocks": len(hashes),
             "cached_blocks": pack_hashes(hashes), "in_flight": in_flight}
    if stats is not None:
        state.update(waiting=stats.waiting, running=stats.running, kv_usage=stats.kv_usage)
    return state

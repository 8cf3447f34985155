import pytest

from slipstream.cache.block_pool import BlockPool
from slipstream.cache.prefix_cache import BlockHasher


def test_allocate_and_free_counts():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert pool.num_free_blocks == 1 and all(b.ref_cnt == 1 for b in a)
    with pytest.raises(RuntimeError):
        pool.allocate(2)
    pool.free(a)
    assert pool.num_free_blocks == 4 and all(b.ref_cnt == 0 for b in a)


def test_cached_block_survives_free_until_reused_lru():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.cache_block(a, b"ha")
    pool.cache_block(b, b"hb")
    pool.free([a])     # freed first: evicted first
    pool.free([b])
    assert pool.lookup(b"ha") is a and pool.lookup(b"hb") is b
    (x,) = pool.allocate(1)
    assert x is a and pool.lookup(b"ha") is None and pool.lookup(b"hb") is b
    assert x.block_hash is None


def test_touch_takes_a_free_cached_block_off_the_free_queue():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache_block(a, b"h")
    pool.free([a, b])
    hit = pool.lookup(b"h")
    pool.touch([hit])
    assert hit.ref_cnt == 1 and pool.num_free_blocks == 1
    (y,) = pool.allocate(1)
    assert y is b          # the touched block is not handed out
    pool.touch([hit])      # a second sharer
    pool.free([hit])
    assert hit.ref_cnt == 1 and pool.num_free_blocks == 0


def test_duplicate_hash_keeps_first_block():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache_block(a, b"h")
    pool.cache_block(b, b"h")
    assert pool.lookup(b"h") is a and b.block_hash is None


def test_caching_disabled_finds_nothing():
    pool = BlockPool(2, enable_caching=False)
    a, _ = pool.allocate(2)
    pool.cache_block(a, b"h")
    assert pool.lookup(b"h") is None


def test_block_hashes_chain():
    h = BlockHasher(block_size=2)
    x, y = [], []
    h.extend(x, [1, 2, 3, 4, 5])
    h.extend(y, [9, 2, 3, 4])
    assert len(x) == 2 and len(y) == 2
    assert x[0] != y[0]
    assert x[1] != y[1]  # same tokens [3, 4], different prefix
    z = []
    h.extend(z, [1, 2, 3, 4])
    assert z == x

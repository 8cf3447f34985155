"""The router's choice: the longest cached prefix, else the lightest load (no processes)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from slipstream.router.instance_state import pack_hashes, unpack_hashes
from slipstream.router.policy import Router


H1, H2, H3, H5, H6, H7, H9 = (bytes([i]) * 8 for i in (1, 2, 3, 5, 6, 7, 9))


def _state(*hashes: bytes) -> dict:
    return {"block_size": 4, "hash_bytes": 8, "cached_blocks": pack_hashes(list(hashes))}


def _router(n=3, **kw) -> Router:
    r = Router([f"http://h:{i}" for i in range(n)], **kw)
    for i in r.instances:
        i.update({"block_size": 4, "cached_blocks": ""})
    return r


def test_longest_cached_prefix_wins():
    r = _router()
    a, b, c = r.instances
    a.update(_state(H1))
    b.update(_state(H1, H2))
    assert r.choose([H1, H2, H3]) == (b, 2)
    assert r.choose([H1, H9]) in ((a, 1), (b, 1))
    assert r.block_size == 4


def test_no_prefix_goes_to_the_lightest_then_the_least_recently_chosen():
    r = _router()
    a, b, c = r.instances
    a.in_flight, b.in_flight, c.in_flight = 2, 0, 0
    first, _ = r.choose([])
    assert first in (b, c)
    r.routed(first, [])
    second, _ = r.choose([])
    assert second in (b, c) and second is not first


def test_a_routed_prompt_counts_as_cached_until_a_poll_says_otherwise():
    r = _router()
    a = r.instances[0]
    r.routed(a, [H5, H6])
    assert r.choose([H5, H6, H7]) == (a, 2)


def test_load_imbalance_overrides_the_prefix():
    r = _router(2, max_imbalance=2)
    a, b = r.instances
    a.update(_state(H1))
    a.in_flight = 2
    assert r.choose([H1]) == (a, 1)
    a.in_flight = 3
    assert r.choose([H1]) == (b, 0)


def test_dead_and_excluded_instances_are_skipped():
    r = _router(2)
    a, b = r.instances
    a.update(_state(H1))
    a.down("refused")
    assert r.choose([H1]) == (b, 0)
    assert r.choose([H1], exclude={b.url}) is None
    with pytest.raises(ValueError, match="--instances"):
        Router([])
    with pytest.raises(ValueError, match="twice"):
        Router(["http://x:1", "http://x:1"])


@pytest.mark.parametrize("argv, message", [
    (["--instances", "foo"], "'foo' is not an http:// URL"),
    (["--instances", "http://a:1", "--poll-interval", "0"], "--poll-interval must be positive"),
    (["--instances", "http://a:1", "--port", "70000"], "--port must be in"),
])
def test_router_options_are_checked_before_anything_loads(argv, message):
    root = Path(__file__).resolve().parents[2]
    probe = ("import sys; from slipstream.cli import main; rc = main(sys.argv[1:]); "
             "print('RESULT', rc, 'torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", probe, "router", *argv], capture_output=True,
                       text=True, cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
    assert "RESULT 2 False" in r.stdout and message in r.stderr


def test_hashes_travel_truncated_and_packed():
    full = [bytes(range(i, i + 16)) for i in range(3)]
    assert unpack_hashes(pack_hashes(full)) == {h[:8] for h in full}
    assert unpack_hashes("") == set()
    r = _router(1)
    with pytest.raises(ValueError, match="4-byte block hashes"):
        r.instances[0].update({"block_size": 4, "hash_bytes": 4, "cached_blocks": ""})

"""Where the router sends a request: the longest cached prefix, else the lightest load.

Each instance has a view: the block hashes it reported at its last poll
(truncated to HASH_BYTES, as are the prompts' hashes compared with them)
(`GET /v1/cache/state`), plus the hashes of the prompts routed to it since
(for a while), since a prompt's blocks are cached there as soon as it runs:
a second request sharing the prefix that comes before the next poll still
finds it. The load is the router's own count of requests in flight there.

Choice: among live instances, the one whose view holds the longest run of the
prompt's leading block hashes, unless its load exceeds the lightest
instance's by more than `max_imbalance` requests; with no cached prefix
anywhere, the lightest load, ties to the instance chosen least recently.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from slipstream.router.instance_state import HASH_BYTES, unpack_hashes

# Routed prompts' hashes count as cached there this long without a poll saying so.
ROUTED_TTL_S = 30.0


@dataclass
class Instance:
    url: str
    alive: bool = False
    last_error: str | None = None
    block_size: int | None = None
    reported: set[bytes] = field(default_factory=set)     # hashes at the last poll
    routed: dict[bytes, float] = field(default_factory=dict)   # hash -> time routed
    in_flight: int = 0
    requests: int = 0          # routed here in all
    last_chosen: int = 0       # order of the last choice (ties go to the oldest)

    def holds(self, h: bytes, now: float) -> bool:
        if h in self.reported:
            return True
        t = self.routed.get(h)
        return t is not None and now - t < ROUTED_TTL_S

    def matched_blocks(self, hashes: list[bytes], now: float) -> int:
        n = 0
        for h in hashes:
            if not self.holds(h, now):
                break
            n += 1
        return n

    def update(self, state: dict) -> None:
        """A poll answered (instance_state.py): its hashes replace the reported view."""
        if int(state.get("hash_bytes", HASH_BYTES)) != HASH_BYTES:
            raise ValueError(f"the instance reports {state['hash_bytes']}-byte block hashes, "
                             f"this router reads {HASH_BYTES}-byte ones (another version)")
        self.alive, self.last_error = True, None
        self.block_size = int(state["block_size"])
        self.reported = unpack_hashes(state.get("cached_blocks", ""))
        now = time.monotonic()
        self.routed = {h: t for h, t in self.routed.items() if now - t < ROUTED_TTL_S}

    def down(self, error: str) -> None:
        self.alive, self.last_error = False, error

    def describe(self) -> dict:
        return {"url": self.url, "alive": self.alive, "last_error": self.last_error,
                "in_flight": self.in_flight, "requests": self.requests,
                "cached_blocks": len(self.reported), "block_size": self.block_size}


class Router:
    def __init__(self, urls: list[str], max_imbalance: int = 8):
        if not urls:
            raise ValueError("--instances: give at least one instance URL")
        if len(set(urls)) != len(urls):
            raise ValueError("--instances: an instance is listed twice")
        if max_imbalance < 0:
            raise ValueError("--max-imbalance must be at least 0")
        self.instances = [Instance(u.rstrip("/")) for u in urls]
        self.max_imbalance = max_imbalance
        self._order = itertools.count(1)

    @property
    def block_size(self) -> int | None:
        """The instances' block size (they must agree for hashes to compare)."""
        sizes = {i.block_size for i in self.instances if i.block_size is not None}
        return sizes.pop() if len(sizes) == 1 else None

    def live(self, exclude: set[str] = frozenset()) -> list[Instance]:
        return [i for i in self.instances if i.alive and i.url not in exclude]

    def choose(self, hashes: list[bytes], exclude: set[str] = frozenset()) -> tuple[Instance, int] | None:
        """(instance, cached blocks of the prompt there), or None when none is live."""
        live = self.live(exclude)
        if not live:
            return None
        now = time.monotonic()
        lightest = min(i.in_flight for i in live)
        matched = {i.url: i.matched_blocks(hashes, now) for i in live}
        fair = [i for i in live if i.in_flight - lightest <= self.max_imbalance]
        best = max(matched[i.url] for i in fair)
        pool = [i for i in fair if matched[i.url] == best]
        if best == 0:
            pool = [i for i in live if i.in_flight == lightest]
        pick = min(pool, key=lambda i: (i.in_flight, i.last_chosen))
        return pick, matched[pick.url]

    def routed(self, inst: Instance, hashes: list[bytes]) -> None:
        inst.last_chosen = next(self._order)
        inst.requests += 1
        now = time.monotonic()
        for h in hashes:
            inst.routed[h] = now

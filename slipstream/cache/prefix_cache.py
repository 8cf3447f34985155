"""Chained block hashes: the identity of a full KV block is its tokens plus
everything before it, so equal hashes mean equal K/V (for one model)."""
from __future__ import annotations

import hashlib
from array import array


class BlockHasher:
    """Hashes every full `block_size` chunk of a token list, chaining each
    block's digest into the next one's."""

    def __init__(self, block_size: int):
        self.block_size = block_size

    def block_hash(self, parent: bytes | None, tokens: list[int]) -> bytes:
        h = hashlib.blake2b(digest_size=16)
        if parent is not None:
            h.update(parent)
        h.update(array("q", tokens).tobytes())
        return h.digest()

    def extend(self, hashes: list[bytes], token_ids: list[int]) -> None:
        """Append the hashes of the full blocks of `token_ids` not yet in `hashes`."""
        bs = self.block_size
        while (len(hashes) + 1) * bs <= len(token_ids):
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(self.block_hash(parent, token_ids[i * bs:(i + 1) * bs]))

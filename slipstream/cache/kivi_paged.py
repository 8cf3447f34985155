"""KIVI (2 or 4 bits) in the engine's paged KV cache, for one attention layer.

`kv_cache_dtype="kivi4"` / `"kivi2"`: a block of the engine's cache is a KIVI
key group (`block_size` tokens). A request's newest tokens stay in full
precision (KIVI's window): the block it is filling and its last `residual`
complete blocks (residual = 32 tokens' worth, KIVI's default). Older blocks are
quantized and sealed: keys per channel over the block's tokens, values per
token over groups of 32 channels, asymmetric codes with fp16 scales and zeros
(quant/kivi.py), packed in the layout of cache/kivi_cache.py but indexed by the
engine's block ids. So a request of L tokens holds (L // block_size - residual)
sealed blocks, which is what `kivi_fake_quantize(..., group=block_size,
residual=residual * block_size)` quantizes (a test checks it). A finished
request's full window blocks are sealed too (they may serve prefix-cache hits,
which share full blocks only), its partial one dropped. Tokens are stored in
order (the engine writes a request's slots in order; speculative decoding,
whose rollback would rewrite slots, does not run over a KIVI cache).

Memory: codes and scales of every block, sized by the pool planner, plus the
windows of the running requests (at most residual + 1 blocks each). Plain
PyTorch, served by the torch attention backend: for memory and quality, not
speed.
"""
from __future__ import annotations

import torch

from slipstream.cache.kivi_cache import allocate_pages, write_page
from slipstream.quant.kivi import asym_dequantize, check_bits, dequantize_values
from slipstream.quant.primitives import unpack_codes

CHANNEL_GROUP = 32
RESIDUAL_TOKENS = 32   # KIVI's full-precision recent tokens (rounded up to blocks)


def kivi_bytes_per_token(num_kv_heads: int, head_dim: int, bits: int, block_size: int) -> float:
    """Sealed storage of one token and layer, K and V: codes, and the fp16 scale and
    zero of each key channel (per block) and of each value channel group (per token)."""
    cg = min(CHANNEL_GROUP, head_dim)
    k = head_dim * bits / 8 + 2 * 2 * head_dim / block_size
    v = head_dim * bits / 8 + 2 * 2 * head_dim / cg
    return num_kv_heads * (k + v)


class PagedKIVI:
    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 bits: int, dtype: torch.dtype, device: torch.device | str,
                 residual_tokens: int = RESIDUAL_TOKENS):
        check_bits(bits)
        cg = min(CHANNEL_GROUP, head_dim)
        if block_size * bits % 8 or head_dim % cg or cg * bits % 8:
            raise ValueError(f"kv_cache_dtype=kivi{bits}: block_size {block_size} and head_dim "
                             f"{head_dim} must fill whole bytes of codes")
        self.bits, self.block_size, self.channel_group = bits, block_size, cg
        self.residual = -(-residual_tokens // block_size)     # complete blocks kept exact
        self.dtype, self.device = dtype, torch.device(device)
        allocate_pages(self, num_blocks, num_kv_heads, head_dim, block_size, bits, cg, device)
        # block id -> [K, V [block_size, h, d] in the model dtype, slots filled], unsealed
        self.window: dict[int, list] = {}

    def sealed_blocks(self, length: int) -> int:
        """Blocks of a request of `length` tokens that hold codes."""
        return max(0, length // self.block_size - self.residual)

    def store(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """k, v: [n, kv_heads, head_dim] of this step's tokens, written to `slots`
        (block id * block_size + offset), a request's in order."""
        bs = self.block_size
        slots = slots.tolist()
        i = 0
        while i < len(slots):
            block, off = divmod(slots[i], bs)
            j = i
            while j + 1 < len(slots) and slots[j + 1] == slots[j] + 1 and (slots[j + 1] % bs):
                j += 1                               # a run of consecutive slots in one block
            entry = self.window.get(block)
            if off == 0 or entry is None:            # a block handed out (again)
                h, d = k.shape[1:]
                entry = self.window[block] = [
                    torch.zeros(bs, h, d, dtype=self.dtype, device=self.device),
                    torch.zeros(bs, h, d, dtype=self.dtype, device=self.device), 0]
            n = j - i + 1
            entry[0][off:off + n] = k[i:j + 1]
            entry[1][off:off + n] = v[i:j + 1]
            entry[2] = off + n
            i = j + 1

    def seal(self, block_table: torch.Tensor, length: int) -> None:
        """Quantize the request's blocks that left its window."""
        for b in block_table[:self.sealed_blocks(length)].tolist():
            entry = self.window.get(b)
            if entry is not None and entry[2] == self.block_size:
                write_page(self, b, entry[0], entry[1])
                del self.window[b]

    def finish(self, block_ids) -> None:
        """A request ended: its full window blocks are sealed, a partial one dropped."""
        for b in block_ids:
            entry = self.window.pop(int(b), None)
            if entry is not None and entry[2] == self.block_size:
                write_page(self, int(b), entry[0], entry[1])

    def read(self, block_table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One request's first `length` keys and values [length, kv_heads, head_dim]
        (fp32): sealed blocks dequantized, window blocks as stored."""
        bs = self.block_size
        if length == 0:
            h, d = self.k_scale.shape[1:]
            empty = torch.zeros(0, h, d, device=self.k_scale.device)
            return empty, empty.clone()
        ids = block_table[:-(-length // bs)].tolist()
        coded = [b not in self.window for b in ids]
        ks = vs = None
        if any(coded):
            sel = torch.tensor([b for b, c in zip(ids, coded) if c], dtype=torch.long,
                               device=self.k_codes.device)
            codes = unpack_codes(self.k_codes[sel], self.bits)              # [b, h, d, G]
            ks = asym_dequantize(codes.permute(0, 3, 1, 2), self.k_scale[sel][:, None],
                                 self.k_zero[sel][:, None])                 # [b, G, h, d]
            vcodes = unpack_codes(self.v_codes[sel], self.bits)            # [b, G, h, d]
            vs = dequantize_values(vcodes.flatten(0, 1), self.v_scale[sel].flatten(0, 1)[..., None],
                                   self.v_zero[sel].flatten(0, 1)[..., None]).unflatten(0, (-1, bs))
        out_k, out_v, c = [], [], 0
        for b, is_coded in zip(ids, coded):
            if is_coded:
                out_k.append(ks[c])
                out_v.append(vs[c])
                c += 1
            else:
                out_k.append(self.window[b][0].float())
                out_v.append(self.window[b][1].float())
        return torch.cat(out_k)[:length], torch.cat(out_v)[:length]

    @property
    def window_bytes(self) -> int:
        """Memory of the unsealed blocks (full precision)."""
        return sum(2 * e[0].numel() * e[0].element_size() for e in self.window.values())

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
which share full blocks only), its partial one dropped. Speculative decoding,
whose rollback would rewrite slots of a sealed block, does not run over a KIVI
cache.

Window blocks live in a pool of full-precision slots, `win_k` / `win_v`
[slots, block_size, kv_heads, head_dim], and `win_of[block]` (int32, on the
device) is the block's slot or -1 when the block is sealed (its codes hold it).
So a kernel reads any block of a request from its block id alone:
kernels/kivi_decode.py does for decode steps on the Triton backend, and the C
decode attention of kernels/cpu_attention.py on the CPU (also inside the one-call
decode step, kernels/cpu_decoder.py); other steps read through `read`. The slots are handed out and taken back on the
host (the `window` dict: block -> [slot, tokens filled]).

Memory: codes and scales of every block, sized by the pool planner, plus the
window pool: on a GPU allocated at its most up front and set aside by the
planner (runner/memory.py `kivi_window_bytes`: residual + 2 blocks a running
request, plus the blocks one step's tokens may open); elsewhere it starts small
and doubles when a step needs more slots than it has.
"""
from __future__ import annotations

import numpy as np
import torch

from slipstream.cache.kivi_cache import allocate_pages, write_pages
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


def _host(x) -> np.ndarray:
    return x if isinstance(x, np.ndarray) else np.asarray(x.tolist() if torch.is_tensor(x) else x)


def _to(device: torch.device, values, dtype=torch.int64) -> torch.Tensor:
    """Host ints -> a device tensor without a host-device sync: on a GPU through pinned
    memory and an asynchronous copy (a plain copy from pageable memory waits for the
    GPU to drain its queue, once per layer and step)."""
    t = torch.as_tensor(np.asarray(values), dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class PagedKIVI:
    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 bits: int, dtype: torch.dtype, device: torch.device | str,
                 residual_tokens: int = RESIDUAL_TOKENS, window_slots: int = 16):
        check_bits(bits)
        cg = min(CHANNEL_GROUP, head_dim)
        if block_size * bits % 8 or head_dim % cg or cg * bits % 8:
            raise ValueError(f"kv_cache_dtype=kivi{bits}: block_size {block_size} and head_dim "
                             f"{head_dim} must fill whole bytes of codes")
        self.bits, self.block_size, self.channel_group = bits, block_size, cg
        self.residual = -(-residual_tokens // block_size)     # complete blocks kept exact
        self.dtype, self.device = dtype, torch.device(device)
        allocate_pages(self, num_blocks, num_kv_heads, head_dim, block_size, bits, cg, device)
        shape = (max(1, window_slots), block_size, num_kv_heads, head_dim)
        self.win_k = torch.zeros(shape, dtype=dtype, device=device)
        self.win_v = torch.zeros(shape, dtype=dtype, device=device)
        self.win_of = torch.full((num_blocks,), -1, dtype=torch.int32, device=device)
        self._free = list(range(shape[0] - 1, -1, -1))
        # block id -> [slot, tokens filled], the unsealed blocks
        self.window: dict[int, list[int]] = {}

    def sealed_blocks(self, length: int) -> int:
        """Blocks of a request of `length` tokens that hold codes."""
        return max(0, length // self.block_size - self.residual)

    # ---- window slots -------------------------------------------------------

    def _take_slot(self) -> int:
        if not self._free:   # grow the pool (the kernels take its address at each call)
            n = self.win_k.shape[0]
            self.win_k = torch.cat([self.win_k, torch.zeros_like(self.win_k)])
            self.win_v = torch.cat([self.win_v, torch.zeros_like(self.win_v)])
            self._free = list(range(2 * n - 1, n - 1, -1))
        return self._free.pop()

    def _release(self, blocks: list[int]) -> None:
        for b in blocks:
            self._free.append(self.window.pop(b)[0])
        if blocks:
            # (index_fill_: an assignment of a Python scalar copies it to the device
            # synchronously)
            self.win_of.index_fill_(0, _to(self.device, blocks), -1)

    def _seal(self, blocks: list[int]) -> None:
        """Quantize these full window blocks into their pages and free their slots."""
        if not blocks:
            return
        slots = _to(self.device, [self.window[b][0] for b in blocks])
        write_pages(self, _to(self.device, blocks), self.win_k[slots],
                    self.win_v[slots])
        self._release(blocks)

    # ---- the engine's calls -------------------------------------------------

    def store(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
              slots_host: np.ndarray | None = None) -> None:
        """k, v: [n, kv_heads, head_dim] of this step's tokens, written to `slots`
        (block id * block_size + offset; -1: padding, not written). `slots_host`:
        the same on the host, if the caller has it (else read back from `slots`)."""
        pool = self.reserve(slots, slots_host)
        keep = pool >= 0
        if not keep.any():
            return
        if not keep.all():
            rows = _to(self.device, np.flatnonzero(keep))
            k, v, pool = k[rows], v[rows], pool[keep]
        idx = _to(self.device, pool)
        h, d = self.win_k.shape[2:]
        self.win_k.view(-1, h, d).index_copy_(0, idx, k.to(self.dtype))
        self.win_v.view(-1, h, d).index_copy_(0, idx, v.to(self.dtype))

    def reserve(self, slots: torch.Tensor, slots_host: np.ndarray | None = None) -> np.ndarray:
        """The bookkeeping of `store` without the writes: window slots for the blocks
        these tokens open; returns each token's row in the window pool viewed as
        [slots * block_size, kv_heads, head_dim] (-1 for padding), for a kernel that
        writes the rows itself (kernels/cpu_attention.py)."""
        s = _host(slots if slots_host is None else slots_host).astype(np.int64)
        out = np.full(len(s), -1, dtype=np.int64)
        keep = s >= 0
        s = s[keep]
        if not len(s):
            return out
        bs = self.block_size
        if len(s) <= 16:   # decode steps: a token or a few, plain Python is quicker
            return self._reserve_few(s, keep, out)
        blocks, offs = s // bs, s % bs
        ub, inv = np.unique(blocks, return_inverse=True)
        filled = np.zeros(len(ub), dtype=np.int64)
        np.maximum.at(filled, inv, offs + 1)
        restart = np.zeros(len(ub), dtype=bool)   # written from offset 0: handed out (again)
        restart[inv[offs == 0]] = True
        new, slot_of = [], np.empty(len(ub), dtype=np.int64)
        for i, (b, n, r) in enumerate(zip(ub.tolist(), filled.tolist(), restart.tolist())):
            entry = self.window.get(b)
            if entry is None:
                entry = self.window[b] = [self._take_slot(), 0]
                new.append(b)
            elif r:
                entry[1] = 0
            entry[1] = max(entry[1], n)
            slot_of[i] = entry[0]
        if new:
            self.win_of[_to(self.device, new)] = _to(
                self.device, [self.window[b][0] for b in new], torch.int32)
        out[keep] = slot_of[inv] * bs + offs
        return out

    def _reserve_few(self, s: np.ndarray, keep: np.ndarray, out: np.ndarray) -> np.ndarray:
        """`reserve` token by token (the same result)."""
        bs, seen, new, rows = self.block_size, set(), [], []
        for x in s.tolist():
            b, o = divmod(x, bs)
            entry = self.window.get(b)
            if entry is None:
                entry = self.window[b] = [self._take_slot(), 0]
                new.append(b)
            elif o == 0 and b not in seen:
                entry[1] = 0          # handed out again: written from offset 0
            seen.add(b)
            entry[1] = max(entry[1], o + 1)
            rows.append(entry[0] * bs + o)
        if new:
            self.win_of[_to(self.device, new)] = _to(
                self.device, [self.window[b][0] for b in new], torch.int32)
        out[keep] = rows
        return out

    def seal(self, block_table, length: int) -> None:
        """Quantize the request's blocks that left its window."""
        self.seal_many([block_table], [length])

    def seal_many(self, block_tables, lengths, newest_only: bool = False) -> None:
        """`seal` for several requests at once (one quantization for all their blocks).
        block_tables: rows of block ids (tensors, arrays or lists); lengths: ints.
        newest_only: look at each request's newest block to seal only (decode steps:
        the blocks before it were sealed at the steps before)."""
        todo = []
        for table, length in zip(block_tables, lengths):
            n = self.sealed_blocks(int(length))
            if n:
                for b in _host(table[n - 1:n] if newest_only else table[:n]).tolist():
                    entry = self.window.get(b)
                    if entry is not None and entry[1] == self.block_size:
                        todo.append(b)
        self._seal(list(dict.fromkeys(todo)))

    def finish(self, block_ids) -> None:
        """A request ended: its full window blocks are sealed, a partial one dropped."""
        full, partial = [], []
        for b in block_ids:
            entry = self.window.get(int(b))
            if entry is not None:
                (full if entry[1] == self.block_size else partial).append(int(b))
        self._seal(full)
        self._release(partial)

    def read(self, block_table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One request's first `length` keys and values [length, kv_heads, head_dim]
        (fp32): sealed blocks dequantized, window blocks as stored."""
        bs = self.block_size
        if length == 0:
            h, d = self.k_scale.shape[1:]
            empty = torch.zeros(0, h, d, device=self.k_scale.device)
            return empty, empty.clone()
        ids = _host(block_table[:-(-length // bs)]).tolist()
        coded = [b not in self.window for b in ids]
        ks = vs = None
        if any(coded):
            sel = _to(self.device, [b for b, c in zip(ids, coded) if c])
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
                slot = self.window[b][0]
                out_k.append(self.win_k[slot].float())
                out_v.append(self.win_v[slot].float())
        return torch.cat(out_k)[:length], torch.cat(out_v)[:length]

    @property
    def window_bytes(self) -> int:
        """Memory of the window pool (full precision)."""
        return 2 * self.win_k.numel() * self.win_k.element_size()

"""A paged KIVI cache (2 or 4 bits) for one attention layer: reference layout.

Pages hold `group` tokens, the key quantization group, so a page is written
once, when its group completes, and never touched again:

    k_codes  uint8 [num_pages, kv_heads, head_dim, group * bits / 8]   per channel,
                                                                      packed along tokens
    k_scale, k_zero  fp16 [num_pages, kv_heads, head_dim]
    v_codes  uint8 [num_pages, group, kv_heads, head_dim * bits / 8]   per token,
                                                                      packed along channels
    v_scale, v_zero  fp16 [num_pages, group, kv_heads, head_dim / channel_group]

Each sequence keeps its newest tokens in full precision (the window: the
incomplete group plus the last `residual` tokens, at most group + residual - 1
of them); `append` moves the oldest complete group of the window into a page.
`read` gives the sequence's keys and values as the kernels would see them
(quant/kivi.py's `kivi_fake_quantize` of the whole sequence, exactly).

This is the format's reference: plain PyTorch, one sequence at a time, not
wired into the engine's block manager or attention backends, and not fast.
Per token and KV head, K and V, at head_dim 128 and group 32: 4 bits take 160
bytes in pages (codes 128, scales and zeros 32) against 512 in fp16; 2 bits 96;
plus each sequence's window in fp16.
"""
from __future__ import annotations

import torch

from slipstream.quant.kivi import (
    asym_dequantize, asym_quantize, check_bits, dequantize_values, quantize_values)
from slipstream.quant.primitives import pack_codes, unpack_codes


class KIVICache:
    def __init__(self, num_pages: int, num_kv_heads: int, head_dim: int, bits: int,
                 group: int = 32, residual: int = 0, channel_group: int = 32,
                 dtype: torch.dtype = torch.float16, device: str | torch.device = "cpu"):
        check_bits(bits)
        channel_group = min(channel_group, head_dim)
        if group * bits % 8 or head_dim % channel_group or channel_group * bits % 8:
            raise ValueError("kv_cache_dtype: KIVI groups must fill whole bytes of codes")
        self.bits, self.group, self.residual, self.channel_group = bits, group, residual, channel_group
        self.dtype, self.device = dtype, torch.device(device)
        allocate_pages(self, num_pages, num_kv_heads, head_dim, group, bits, channel_group, device)
        self.free = list(range(num_pages - 1, -1, -1))
        self.pages: dict[str, list[int]] = {}
        self.window: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def add(self, seq_id: str) -> None:
        h, d = self.k_scale.shape[1:]
        empty = torch.empty(0, h, d, dtype=self.dtype, device=self.device)
        self.pages[seq_id], self.window[seq_id] = [], (empty, empty.clone())

    def release(self, seq_id: str) -> None:
        self.free.extend(self.pages.pop(seq_id))
        self.window.pop(seq_id)

    def __len__(self) -> int:
        return len(self.pages)

    def num_tokens(self, seq_id: str) -> int:
        return len(self.pages[seq_id]) * self.group + self.window[seq_id][0].shape[0]

    def append(self, seq_id: str, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [n, kv_heads, head_dim], the sequence's next n tokens."""
        wk, wv = self.window[seq_id]
        wk, wv = torch.cat([wk, k.to(self.dtype)]), torch.cat([wv, v.to(self.dtype)])
        while wk.shape[0] - self.residual >= self.group:
            self._write_page(seq_id, wk[:self.group], wv[:self.group])
            wk, wv = wk[self.group:], wv[self.group:]
        self.window[seq_id] = (wk, wv)

    def _write_page(self, seq_id: str, k: torch.Tensor, v: torch.Tensor) -> None:
        if not self.free:
            raise RuntimeError("the KIVI cache is out of pages")
        p = self.free.pop()
        self.pages[seq_id].append(p)
        write_page(self, p, k, v)

    def read(self, seq_id: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The sequence's keys and values [tokens, kv_heads, head_dim] (fp32)."""
        ks, vs = [], []
        for p in self.pages[seq_id]:
            codes = unpack_codes(self.k_codes[p], self.bits).permute(2, 0, 1)   # [G, h, d]
            ks.append(asym_dequantize(codes, self.k_scale[p][None], self.k_zero[p][None]))
            vs.append(dequantize_values(unpack_codes(self.v_codes[p], self.bits),
                                        self.v_scale[p][..., None], self.v_zero[p][..., None]))
        wk, wv = self.window[seq_id]
        return torch.cat(ks + [wk.float()]), torch.cat(vs + [wv.float()])

    def bytes_per_token(self, seq_id: str | None = None) -> float:
        """Storage per token over all KV heads, K and V together: the pages' codes,
        scales and zeros, plus (for `seq_id`) its full-precision window."""
        page = sum(t[0].numel() * t.element_size() for t in
                   (self.k_codes, self.k_scale, self.k_zero, self.v_codes, self.v_scale, self.v_zero))
        if seq_id is None:
            return page / self.group
        n = self.num_tokens(seq_id)
        wk = self.window[seq_id][0]
        window = 2 * wk.numel() * wk.element_size()
        return (len(self.pages[seq_id]) * page + window) / max(n, 1)


def allocate_pages(owner, num_pages: int, num_kv_heads: int, head_dim: int, group: int,
                   bits: int, channel_group: int, device) -> None:
    """The page tensors on `owner` (zeroed): k_codes [pages, h, d, group / per byte]
    (per channel, packed along tokens), k_scale / k_zero [pages, h, d] fp16,
    v_codes [pages, group, h, d / per byte] (per token, packed along channels),
    v_scale / v_zero [pages, group, h, d / channel_group] fp16."""
    h, d, per = num_kv_heads, head_dim, 8 // bits
    u8, f16 = dict(dtype=torch.uint8, device=device), dict(dtype=torch.float16, device=device)
    owner.k_codes = torch.zeros(num_pages, h, d, group // per, **u8)
    owner.k_scale = torch.zeros(num_pages, h, d, **f16)
    owner.k_zero = torch.zeros(num_pages, h, d, **f16)
    owner.v_codes = torch.zeros(num_pages, group, h, d // per, **u8)
    owner.v_scale = torch.zeros(num_pages, group, h, d // channel_group, **f16)
    owner.v_zero = torch.zeros(num_pages, group, h, d // channel_group, **f16)


def write_page(owner, p: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """Quantize one group of keys and values [group, h, d] into page p of `owner`
    (which has `bits`, `channel_group` and the tensors of `allocate_pages`)."""
    write_pages(owner, torch.tensor([p], device=owner.k_codes.device), k[None], v[None])


def write_pages(owner, pages: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """`write_page` for n pages at once: k, v [n, group, h, d] into `pages` [n]."""
    n, g, h, d = k.shape
    codes, scale, zero = asym_quantize(k.float(), owner.bits, dim=1)        # per channel
    owner.k_codes[pages] = pack_codes(codes.permute(0, 2, 3, 1), owner.bits)  # [n, h, d, G/per]
    owner.k_scale[pages], owner.k_zero[pages] = scale[:, 0], zero[:, 0]
    codes, scale, zero = quantize_values(v.float().reshape(n * g, h, d), owner.bits,
                                         owner.channel_group)
    owner.v_codes[pages] = pack_codes(codes, owner.bits).view(n, g, h, -1)
    owner.v_scale[pages] = scale[..., 0].view(n, g, h, -1)
    owner.v_zero[pages] = zero[..., 0].view(n, g, h, -1)

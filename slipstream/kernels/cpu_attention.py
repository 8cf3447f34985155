"""Decode attention on the CPU over the paged KV cache (launcher for `cpu_quant.c`).

One new token per sequence; each (sequence, head) walks its block table and
reads K/V rows in place with an online softmax, so no step gathers the whole
context into a new tensor. The step's new K/V can be written to the cache in
the same call (`k`, `v`, `slot_mapping`), which saves the half-dozen indexing
ops of a torch store per layer. Twin: `cpu_reference.decode_attention`.
"""
from __future__ import annotations

import torch

from slipstream.kernels import cpu_library

KV_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def supported(k_cache: torch.Tensor, head_dim: int) -> bool:
    return (cpu_library.load() is not None and k_cache.device.type == "cpu"
            and k_cache.dtype in KV_DTYPES and head_dim <= 512)


def _rows(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """fp32, heads-by-dim contiguous within each token; -> (tensor, token stride)."""
    if t.dtype != torch.float32 or t.stride(-1) != 1 or t.stride(-2) != t.shape[-1]:
        t = t.float().contiguous()
    return t, t.stride(0)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                     sliding_window: int | None = None, k: torch.Tensor | None = None,
                     v: torch.Tensor | None = None, slot_mapping: torch.Tensor | None = None) -> torch.Tensor:
    """q: [num_seqs, num_heads, head_dim]; caches: [num_blocks, block_size, kv_heads, head_dim]
    (fp32 or bf16, contiguous); seq_lens: [num_seqs] int32, counting the new token;
    block_tables: [num_seqs, max_blocks] int32; k, v: [num_seqs, kv_heads, head_dim] and
    slot_mapping [num_seqs] int64, to store first (else already stored)
    -> [num_seqs, num_heads, head_dim] in q's dtype."""
    lib = cpu_library.load()
    b, nh, hd = q.shape
    nkv, bs = k_cache.shape[2], k_cache.shape[1]
    qf, q_stride = _rows(q)
    out = torch.empty(b, nh, hd, dtype=torch.float32)
    lens = seq_lens if seq_lens.dtype == torch.int32 else seq_lens.to(torch.int32)
    tables = block_tables if block_tables.dtype == torch.int32 else block_tables.to(torch.int32)
    lens, tables = lens.contiguous(), tables.contiguous()
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    k_ptr = v_ptr = slot_ptr = None
    k_stride = v_stride = 0
    if k is not None:
        k, k_stride = _rows(k)
        v, v_stride = _rows(v)
        slots = slot_mapping.to(torch.int64).contiguous()
        k_ptr, v_ptr, slot_ptr = k.data_ptr(), v.data_ptr(), slots.data_ptr()
    rc = lib.ss_decode_attention(qf.data_ptr(), q_stride, k_cache.data_ptr(), v_cache.data_ptr(),
                                 KV_DTYPES[k_cache.dtype], tables.data_ptr(), tables.shape[1],
                                 lens.data_ptr(), b, nh, nkv, hd, bs, scale, sliding_window or 0,
                                 k_ptr, k_stride, v_ptr, v_stride, slot_ptr, out.data_ptr())
    assert rc == 0, "ss_decode_attention rejected its arguments"
    return out if q.dtype == torch.float32 else out.to(q.dtype)

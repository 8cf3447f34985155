"""Decode attention on the CPU over the paged KV cache (launcher for `cpu_quant.c`).

One new token per sequence; each (sequence, head) walks its block table and
reads K/V rows in place with an online softmax, so no step gathers the whole
context into a new tensor. Twin: `cpu_reference.decode_attention`.
"""
from __future__ import annotations

import torch

from slipstream.kernels import cpu_library

KV_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def supported(k_cache: torch.Tensor, head_dim: int) -> bool:
    return (cpu_library.load() is not None and k_cache.device.type == "cpu"
            and k_cache.dtype in KV_DTYPES and head_dim <= 512)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                     sliding_window: int | None = None) -> torch.Tensor:
    """q: [num_seqs, num_heads, head_dim]; caches: [num_blocks, block_size, kv_heads, head_dim]
    (fp32 or bf16, contiguous); seq_lens: [num_seqs] int32 (the new token's K/V stored);
    block_tables: [num_seqs, max_blocks] int32 -> [num_seqs, num_heads, head_dim] in q's dtype."""
    lib = cpu_library.load()
    b, nh, hd = q.shape
    nkv, bs = k_cache.shape[2], k_cache.shape[1]
    qf = q.float().contiguous()
    out = torch.empty_like(qf)
    lens = seq_lens.to(torch.int32).contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    rc = lib.ss_decode_attention(qf.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                                 KV_DTYPES[k_cache.dtype], tables.data_ptr(), tables.shape[1],
                                 lens.data_ptr(), b, nh, nkv, hd, bs, scale,
                                 sliding_window or 0, out.data_ptr())
    assert rc == 0, "ss_decode_attention rejected its arguments"
    return out.to(q.dtype)

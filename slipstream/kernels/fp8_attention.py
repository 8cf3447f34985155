"""FP8 prefill attention in the spirit of FlashAttention-3 (chapter 2.6, item 3).

QK^T runs on the FP8 tensor cores; two measures keep its error small:
  * block quantisation: q and k get one float8 e4m3 scale per block of
    `quant_block` consecutive tokens of one request and one head, not one per
    tensor, so a large block does not crush the others' precision;
  * incoherent processing: q and k are first multiplied by one random
    orthogonal matrix R. (qR)(kR)^T = qk^T exactly, but R spreads a few outlier
    channels over all channels, so the per-block maximum, and with it the
    quantisation step, shrinks.
P.V stays in v's dtype (bf16/fp16). Only whole prompts (no cached context) take
this path; the accuracy against bf16 is measured in benchmarks/attention.
"""
from __future__ import annotations

import functools

import torch

from slipstream.kernels.prefill_attention import prefill_attention

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


@functools.cache
def _orthogonal_cpu(head_dim: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(head_dim, head_dim, generator=g, dtype=torch.float64)
    qm, r = torch.linalg.qr(a)
    return (qm * torch.sign(torch.diagonal(r))).to(torch.float32)  # Haar-distributed


def random_orthogonal(head_dim: int, device, seed: int = 0) -> torch.Tensor:
    """A fixed random orthogonal matrix [head_dim, head_dim] fp32 (R @ R.T = I)."""
    return _orthogonal_cpu(head_dim, seed).to(device)


def quantize_fp8_blocks(x: torch.Tensor, cu_seqlens: torch.Tensor,
                        block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [num_tokens, heads, head_dim] -> (x8 float8 e4m3 same shape, scale
    [num_tokens, heads] fp32) with x ~= x8 * scale; every `block` consecutive
    tokens of one request share a scale per head (stored per token, so any
    kernel tile size can read it). No host sync."""
    num_tokens, heads, _ = x.shape
    tok = torch.arange(num_tokens, device=x.device)
    seq = torch.searchsorted(cu_seqlens[1:].long(), tok, right=True)
    first = cu_seqlens.long()[seq]
    block_id = first + (tok - first) // block * block  # first token of the block: unique
    amax = x.detach().abs().amax(-1).float()  # [T, heads]
    block_max = torch.zeros_like(amax).scatter_reduce_(
        0, block_id[:, None].expand(-1, heads), amax, reduce="amax", include_self=False)
    scale = (block_max[block_id] / FP8_MAX).clamp_min(1e-12)
    x8 = (x.float() / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return x8, scale


def fp8_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          cu_seqlens_q: torch.Tensor, max_query_len: int, scale: float, *,
                          causal: bool = True, rotate: bool = True, quant_block: int = 64,
                          out: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads,
    head_dim] (bf16/fp16); whole prompts. returns [num_tokens, num_heads, head_dim]
    in v's dtype."""
    if rotate:
        rot = random_orthogonal(q.shape[-1], q.device)
        q, k = q.float() @ rot, k.float() @ rot
    q8, q_scale = quantize_fp8_blocks(q, cu_seqlens_q, quant_block)
    k8, k_scale = quantize_fp8_blocks(k, cu_seqlens_q, quant_block)
    num_seqs = cu_seqlens_q.shape[0] - 1
    no_context = torch.zeros(num_seqs, dtype=torch.int32, device=q.device)
    no_cache = torch.empty(1, 16, k.shape[1], k.shape[2], dtype=v.dtype, device=q.device)
    no_tables = torch.zeros(num_seqs, 1, dtype=torch.int32, device=q.device)
    return prefill_attention(q8, k8, v, no_cache, no_cache, cu_seqlens_q, no_context, no_tables,
                             max_query_len, scale, causal=causal, q_scale=q_scale, k_scale=k_scale,
                             out=out, config=config)

"""Inputs of the FP8 Gluon prefill kernel (gluon_fp8_prefill.py), and the
plain-PyTorch twin of its arithmetic.

`quantize_fp8_inputs`: Q and K rotated by the existing FP8 path's random
orthogonal matrix (incoherent processing, fp8_attention.py: (qR)(kR)^T = qk^T)
and block-quantised to e4m3 (Q per `q_block` tokens of a request and head, K per
`kv_block`: one scale a kernel tile), V block-quantised per `kv_block` and
transposed to V^T [kv_heads * D, columns] (FP8 wgmma wants P.V's operand K-major:
tokens contiguous), each request's columns from a multiple of 16 (v_columns). Scales
are stored per token, fp32.

`emulate_fp8_prefill`: what the kernel computes, in fp32 on dequantised
inputs, with P cast to e4m3 (QK^T-only: v's dtype) as the kernel does (P * 2^8 relative to the row's
running maximum over the key tiles so far), so the kernel matches it to about
its output's rounding.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from slipstream.kernels.fp8_attention import FP8, quantize_fp8_blocks, random_orthogonal

P_SCALE = 256.0  # gluon_fp8_tile.P_SHIFT = log2(P_SCALE)


class Fp8Inputs(NamedTuple):
    q8: torch.Tensor       # [tokens, heads, D] e4m3
    k8: torch.Tensor       # [tokens, kv_heads, D] e4m3
    v: torch.Tensor        # V^T [kv_heads * D, columns] e4m3; QK^T-only: V [tokens, kv_heads, D] 16-bit
    q_scale: torch.Tensor  # [tokens, heads] fp32
    k_scale: torch.Tensor  # [tokens, kv_heads] fp32
    v_scale: torch.Tensor  # [tokens, kv_heads] fp32
    kv_block: int          # K's and V's scales are constant over kv_block tokens of a request
    v_starts: torch.Tensor  # [num_seqs + 1] int32: each request's first V^T column, a multiple of 16
    v_cols: torch.Tensor   # [tokens] int64: each token's V^T column
    key_perm: bool = False  # V^T's tokens in KEY_PERM_16 order within each 16 (the kernel's KEY_PERM)


# KEY_PERM_16[c]: the V^T column (within its 16) of a request's token c (within its 16):
# column a = a0 + 2 a1 + 4 a2 + 8 a3 holds token a0 + 8 a1 + 2 a2 + 4 a3, the key P.V's
# register A operand holds at column a when P stays in the scores' registers
# (gluon_fp8_tile.p_operand).
KEY_PERM_16 = tuple((c & 1) | ((c >> 3) & 1) << 1 | ((c >> 1) & 1) << 2 | ((c >> 2) & 1) << 3
                    for c in range(16))


def v_columns(cu_seqlens: torch.Tensor, tokens: int, key_perm: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """V^T's token axis: each request starts at a multiple of 16 columns (TMA reads V^T
    tiles from a request's start, and wants that inner coordinate 16-byte aligned);
    key_perm: the tokens of each 16 in KEY_PERM_16 order.
    Returns (v_starts [num_seqs + 1] int32, v_cols [tokens] int64, width: a host bound)."""
    cu = cu_seqlens.long()
    padded = (cu[1:] - cu[:-1] + 15) // 16 * 16
    starts = torch.cat([torch.zeros(1, dtype=torch.long, device=cu.device), padded.cumsum(0)])
    tok = torch.arange(tokens, device=cu.device)
    seq = torch.searchsorted(cu[1:], tok, right=True)
    width = (tokens + 16 * (cu.numel() - 1) + 15) // 16 * 16
    offset = tok - cu[seq]
    if key_perm:
        perm = torch.tensor(KEY_PERM_16, device=cu.device)
        offset = offset // 16 * 16 + perm[offset % 16]
    return starts.int(), starts[seq] + offset, width


def quantize_fp8_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                        *, rotate: bool = True, q_block: int = 64, kv_block: int = 128,
                        fp8_v: bool = True, key_perm: bool = False) -> Fp8Inputs:
    """q [tokens, heads, D], k / v [tokens, kv_heads, D] (any float dtype), cu_seqlens
    [num_seqs + 1] int32 -> Fp8Inputs. kv_block must be a multiple of the kernel's BLOCK_N.
    fp8_v False: QK^T-only FP8 (the existing path's split): v kept as is (bf16 / fp16,
    contiguous), its scale 1; P.V then runs in v's dtype. key_perm (fp8_v only): V^T's tokens
    in KEY_PERM_16 order, for the kernel's shuffle-free P operand (4-11% faster kernel on the
    H200; off by default: the fused quantiser's reorder cost about what it saves, GLUON_FP8.md)."""
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape or q.shape[0] != k.shape[0] \
            or q.shape[2] != k.shape[2]:
        raise ValueError(f"q, k, v must be [tokens, heads, D], k and v alike: "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q_block <= 0 or kv_block not in (64, 128):
        raise ValueError(f"q_block must be positive and kv_block 64 or 128: {q_block}, {kv_block}")
    if rotate:
        rot = random_orthogonal(q.shape[-1], q.device)
        q, k = q.float() @ rot, k.float() @ rot
    q8, q_scale = quantize_fp8_blocks(q, cu_seqlens, q_block)
    k8, k_scale = quantize_fp8_blocks(k, cu_seqlens, kv_block)
    tokens, kv_heads, d = v.shape
    if not fp8_v:
        if v.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"with fp8_v=False v must be bf16 or fp16, got {v.dtype}")
        return Fp8Inputs(q8.contiguous(), k8.contiguous(), v.contiguous(), q_scale.contiguous(),
                         k_scale.contiguous(), torch.ones_like(k_scale), kv_block, cu_seqlens,
                         torch.arange(tokens, device=v.device))
    v8, v_scale = quantize_fp8_blocks(v, cu_seqlens, kv_block)
    v_starts, v_cols, width = v_columns(cu_seqlens, tokens, key_perm)
    vt8 = torch.zeros(kv_heads * d, width, dtype=torch.uint8, device=v.device)
    vt8[:, v_cols] = v8.view(torch.uint8).permute(1, 2, 0).reshape(kv_heads * d, tokens)
    return Fp8Inputs(q8.contiguous(), k8.contiguous(), vt8.view(FP8), q_scale.contiguous(),
                     k_scale.contiguous(), v_scale.contiguous(), kv_block, v_starts, v_cols, key_perm)


def dequantize_fp8_inputs(x: Fp8Inputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v) fp32 as the kernel sees them (q, k still rotated)."""
    tokens, kv_heads, d = x.k8.shape
    v = x.v.float() if x.v.dtype != FP8 else \
        x.v.view(torch.uint8)[:, x.v_cols].view(FP8).reshape(kv_heads, d, tokens).permute(2, 0, 1)
    return (x.q8.float() * x.q_scale[..., None], x.k8.float() * x.k_scale[..., None],
            v.float() * x.v_scale[..., None])


def emulate_fp8_prefill(x: Fp8Inputs, cu_seqlens: torch.Tensor, scale: float, *,
                        causal: bool = True, quantize_p: bool = True, block_n: int = 128) -> torch.Tensor:
    """The kernel's arithmetic in fp32 [tokens, heads, D]: the scores of the dequantised
    q, k; P cast to e4m3 as 2^8 exp(s - m) with m the row's running maximum over the key
    tiles of block_n so far (the online softmax's), rescaled to the final one after the
    cast; l of the unrounded P."""
    q, k, v = dequantize_fp8_inputs(x)
    group = q.shape[1] // k.shape[1]
    out = torch.zeros_like(q)
    starts = cu_seqlens.tolist()
    for a, e in zip(starts[:-1], starts[1:]):
        n = e - a
        qs = q[a:e].transpose(0, 1)                                  # [heads, n, D]
        ks = k[a:e].transpose(0, 1).repeat_interleave(group, 0)
        vs = v[a:e].transpose(0, 1).repeat_interleave(group, 0)
        s = qs @ ks.transpose(1, 2) * scale                          # [heads, n, n]
        if causal:
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
        tiles = -(-n // block_n)
        pad = torch.full((*s.shape[:2], tiles * block_n - n), float("-inf"), device=s.device)
        m_tile = torch.cat([s, pad], -1).view(*s.shape[:2], tiles, block_n).amax(-1)
        m_run = m_tile.cummax(-1).values.repeat_interleave(block_n, -1)[..., :n]
        m_fin = m_run[..., -1:]
        m_run = torch.where(torch.isfinite(m_run), m_run, m_fin)     # keys past a row's last tile
        p = torch.exp(s - m_run) * P_SCALE
        if quantize_p:
            p = p.to(FP8 if x.v.dtype == FP8 else x.v.dtype).float()
        p = p * torch.exp(m_run - m_fin)
        l = (torch.exp(s - m_fin) * P_SCALE).sum(-1, keepdim=True)
        out[a:e] = (p @ vs / l).transpose(0, 1)
    return out

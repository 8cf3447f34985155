"""KIVI (Liu et al., 2024): 2- and 4-bit KV cache numerics, plain PyTorch.

Keys are quantized per channel: a scale and a zero (the minimum) per head dim
over each group of `group` consecutive tokens, because key outliers sit in a
few fixed channels; values per token (over groups of `channel_group` = 32 channels).
A group of keys can only be quantized once it is complete, so the tokens of the
incomplete last group, and with `residual` > 0 the most recent `residual`
tokens as well, stay in full precision: the window of recent tokens. Scale and
zero are stored in fp16 (as in KIVI); codes are unsigned, asymmetric.

This is the reference of the format: `kivi_fake_quantize` gives what a KIVI
cache hands back for one sequence, `kivi_causal_attention` what each query of a
prompt sees when it attends to the cache as it stood at its own step (the
decode-time numerics, computed for a whole prompt at once). The paged layout
with packed codes is cache/kivi_cache.py (the engine's, cache/kivi_paged.py, is read
by kernels/kivi_decode.py in decode steps). This path is for quality measurements
and tests, not speed.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

KIVI_BITS = (2, 4)


def check_bits(bits: int) -> None:
    if bits not in KIVI_BITS:
        raise ValueError(f"kv_cache_dtype: KIVI takes 2 or 4 bits, got {bits}")


def asym_quantize(x: torch.Tensor, bits: int, dim: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric quantization along `dim`: (codes uint8 in [0, 2^bits), scale, zero),
    scale and zero fp16 with `dim` kept (size 1); x ~= codes * scale + zero."""
    qmax = 2 ** bits - 1
    xf = x.float()
    lo, hi = xf.amin(dim, keepdim=True), xf.amax(dim, keepdim=True)
    scale = ((hi - lo) / qmax).clamp_min(1e-6).half()
    zero = lo.half()
    codes = torch.round((xf - zero.float()) / scale.float()).clamp(0, qmax).to(torch.uint8)
    return codes, scale, zero


def asym_dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return codes.float() * scale.float() + zero.float()


def quantize_key_group(k: torch.Tensor, bits: int):
    """k: [group, heads, dim] -> per-channel (codes [group, heads, dim], scale, zero [1, heads, dim])."""
    return asym_quantize(k, bits, dim=0)


def quantize_values(v: torch.Tensor, bits: int, channel_group: int):
    """v: [tokens, heads, dim] -> per-token codes [tokens, heads, dim] and
    scale, zero [tokens, heads, dim // channel_group, 1]."""
    t, h, d = v.shape
    if d % channel_group:
        raise ValueError(f"head_dim {d} is not a multiple of the value channel group {channel_group}")
    codes, scale, zero = asym_quantize(v.reshape(t, h, d // channel_group, channel_group), bits, -1)
    return codes.view(t, h, d), scale, zero


def dequantize_values(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    t, h, d = codes.shape
    g = d // scale.shape[2]
    return asym_dequantize(codes.view(t, h, d // g, g), scale, zero).view(t, h, d)


def quantized_prefix(num_tokens: int, group: int, residual: int) -> int:
    """Tokens in complete key groups outside the full-precision window."""
    return max(0, (num_tokens - residual) // group * group)


def kivi_fake_quantize(k: torch.Tensor, v: torch.Tensor, bits: int, group: int = 32,
                       residual: int = 0, channel_group: int = 32
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence. k, v: [tokens, heads, dim] -> what a KIVI cache holding them
    returns (the quantized prefix dequantized, the window exact), in k's dtype."""
    check_bits(bits)
    n = quantized_prefix(k.shape[0], group, residual)
    kf, vf = k.float().clone(), v.float().clone()
    if n:
        kg = kf[:n].reshape(n // group, group, *k.shape[1:])
        for i in range(n // group):
            kf[i * group:(i + 1) * group] = asym_dequantize(*quantize_key_group(kg[i], bits))
        cg = min(channel_group, k.shape[-1])
        vf[:n] = dequantize_values(*quantize_values(vf[:n], bits, cg))
    return kf.to(k.dtype), vf.to(v.dtype)


def kivi_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                          bits: int, group: int = 32, residual: int = 0,
                          channel_group: int = 32) -> torch.Tensor:
    """Causal attention of one prompt where query t sees the cache as it stood at
    its own step: keys/values of the groups complete (outside the window) by then
    quantized, the rest exact. q: [T, heads, dim]; k, v: [T, kv_heads, dim]
    -> [T, heads, dim] in q's dtype."""
    t = q.shape[0]
    kq, vq = kivi_fake_quantize(k.float(), v.float(), bits, group, residual, channel_group)
    pos = torch.arange(t, device=q.device)
    limit = torch.tensor([quantized_prefix(i + 1, group, residual) for i in range(t)],
                         device=q.device)
    use_q = pos[None, :] < limit[:, None]                        # [T, T]: key j quantized for query i
    causal = pos[None, :] <= pos[:, None]
    qh = q.float().transpose(0, 1)                               # [H, T, D]
    rep = q.shape[1] // k.shape[1]
    kx, kqx = (x.transpose(0, 1).repeat_interleave(rep, 0) for x in (k.float(), kq.float()))
    vx, vqx = (x.transpose(0, 1).repeat_interleave(rep, 0) for x in (v.float(), vq.float()))
    scores = torch.where(use_q, qh @ kqx.transpose(1, 2), qh @ kx.transpose(1, 2)) * scale
    p = F.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
    out = (p * use_q) @ vqx + (p * ~use_q) @ vx
    return out.transpose(0, 1).to(q.dtype)

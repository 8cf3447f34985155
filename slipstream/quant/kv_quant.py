"""KV cache quantization: the formats and their plain-PyTorch reference.

int8: one symmetric scale per (token, kv head): k [tokens, heads, dim] ->
      int8 codes + scale [tokens, heads] fp32 (max |k| / 127 over the head's dim).
      A cache slot holds its token's codes and scales, so a token is quantized once,
      when it is stored, and never re-quantized as the sequence grows.
fp8:  float8 e4m3 with one scale per (token, kv head) (max |k| / 448).
KIVI (Liu et al., 2024), 2 or 4 bits: keys per channel (a scale and zero per head
      dim over a group of `group` consecutive tokens: key outliers live in fixed
      channels), values per token (over the head's dim); the most recent tokens that
      do not fill a group stay in full precision (the residual window).

`fake_quantize_kv` gives the values a kernel reading such a cache would see; the
attention kernels (owned by the attention layer) would read the codes and apply the
scales in registers: K's per-token scale multiplies the score column q.k_j, V's the
probability p_j before the PV product (see the report accompanying this module).
"""
from __future__ import annotations

import torch

from slipstream.quant.primitives import FP8_E4M3_MAX

KV_DTYPES = ("auto", "int8", "fp8", "kivi4", "kivi2")


def quantize_kv_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [tokens, heads, dim] -> (int8 [tokens, heads, dim], scale [tokens, heads] fp32)."""
    scale = (x.float().abs().amax(-1) / 127.0).clamp_min(1e-10)
    q = torch.round(x.float() / scale[..., None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def dequantize_kv_int8(q: torch.Tensor, scale: torch.Tensor,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.float() * scale[..., None]).to(dtype)


def quantize_kv_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [tokens, heads, dim] -> (float8_e4m3fn, scale [tokens, heads] fp32)."""
    scale = (x.float().abs().amax(-1) / FP8_E4M3_MAX).clamp_min(1e-12)
    q = (x.float() / scale[..., None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return q.to(torch.float8_e4m3fn), scale


def dequantize_kv_fp8(q: torch.Tensor, scale: torch.Tensor,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.float() * scale[..., None]).to(dtype)


def _asym(x: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Asymmetric fake quantization along `dim` (min/max over it)."""
    qmax = 2 ** bits - 1
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    scale = ((hi - lo) / qmax).clamp_min(1e-10)
    return (torch.round((x - lo) / scale).clamp(0, qmax)) * scale + lo


def kivi_fake_quantize(k: torch.Tensor, v: torch.Tensor, bits: int, group: int = 32,
                       residual: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """KIVI on one sequence. k, v: [tokens, heads, dim] -> what a KIVI cache returns.

    Keys: per channel over each full group of `group` tokens; values: per token. The
    last `residual` tokens, and the tokens of an incomplete last key group, stay exact
    (for keys and values alike): the full-precision window of recent tokens."""
    if bits not in (2, 4):
        raise ValueError(f"kv_cache_dtype: KIVI takes 2 or 4 bits, got {bits}")
    t = k.shape[0]
    quantized_upto = max(0, ((t - residual) // group) * group)
    kf, vf = k.float().clone(), v.float().clone()
    if quantized_upto:
        kg = kf[:quantized_upto].reshape(quantized_upto // group, group, *k.shape[1:])
        kf[:quantized_upto] = _asym(kg, bits, dim=1).reshape(quantized_upto, *k.shape[1:])
        vf[:quantized_upto] = _asym(vf[:quantized_upto], bits, dim=-1)
    return kf.to(k.dtype), vf.to(v.dtype)


def fake_quantize_kv(x: torch.Tensor, kv_dtype: str) -> torch.Tensor:
    """Per-token formats only (int8, fp8): x [tokens, heads, dim] as a cache returns it."""
    if kv_dtype == "int8":
        return dequantize_kv_int8(*quantize_kv_int8(x), x.dtype)
    if kv_dtype == "fp8":
        return dequantize_kv_fp8(*quantize_kv_fp8(x), x.dtype)
    if kv_dtype == "auto":
        return x
    raise ValueError(f"kv_cache_dtype: expected one of auto, int8, fp8 here, got {kv_dtype!r}")


def kv_bytes_per_token_head(head_dim: int, kv_dtype: str, model_bytes: int = 2) -> float:
    """Storage per token and KV head for K or V, scales included."""
    if kv_dtype in ("int8", "fp8"):
        return head_dim + 4
    if kv_dtype.startswith("kivi"):
        bits = int(kv_dtype[4:])
        return head_dim * bits / 8 + 2 * 2 * head_dim / 32   # fp16 scale+zero per channel/group
    return head_dim * model_bytes

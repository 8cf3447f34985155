"""KV cache quantization: the formats and their plain-PyTorch reference.

int8: one symmetric scale per (token, kv head): k [tokens, heads, dim] ->
      int8 codes + scale [tokens, heads] fp32 (max |k| / 127 over the head's dim),
      codes round half away from zero (the Triton store kernel's rounding).
fp8:  float8 e4m3 codes with one scale per (token, kv head) as well (max |k| / 448),
      computed when the token is stored (dynamic: no calibration). `fp8_e4m3` is
      the same format under its full name.
A cache slot holds its token's codes and scales, so a token is quantized once,
when it is stored, and never re-quantized as the sequence grows. The paged pool
keeps the codes where a 16-bit cache keeps its values ([blocks, page, kv_heads,
head_dim]) and the scales beside them ([blocks, page, kv_heads] fp32); the
attention kernels read the codes and apply the scales in registers: K's scale
multiplies the score column q.k_j, V's the probability p_j before the P.V product.

KIVI (Liu et al., 2024), 2 or 4 bits: keys per channel, values per token, a small
full-precision window of recent tokens: numerics in quant/kivi.py, a paged
reference layout in cache/kivi_cache.py, and in the engine (`kv_cache_dtype`
kivi4 / kivi2, a block a key group) cache/kivi_paged.py, read by the torch
backend and, for decode steps on the triton backend, by kernels/kivi_decode.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from slipstream.quant.primitives import FP8_E4M3_MAX


@dataclass(frozen=True)
class KVFormat:
    """How one KV cache dtype is stored."""
    name: str
    storage: torch.dtype | None   # the codes' dtype; None: the model dtype (no quantization)
    qmax: float = 0.0             # largest code magnitude (scale = amax / qmax)
    kivi_bits: int = 0            # KIVI (2 or 4): codes and scales in cache/kivi_paged.py

    @property
    def quantized(self) -> bool:
        return self.storage is not None

    @property
    def per_token(self) -> bool:
        """Codes and one scale a token and head in the paged pool (int8, fp8)."""
        return self.quantized and not self.kivi_bits

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_kv(x, self)


KV_FORMATS = {
    "auto": KVFormat("auto", None),
    "int8": KVFormat("int8", torch.int8, 127.0),
    "fp8": KVFormat("fp8", torch.float8_e4m3fn, FP8_E4M3_MAX),
    "kivi4": KVFormat("kivi4", torch.uint8, kivi_bits=4),
    "kivi2": KVFormat("kivi2", torch.uint8, kivi_bits=2),
}
_ALIASES = {"fp8_e4m3": "fp8", "bf16": "auto", "bfloat16": "auto"}
# what --kv-cache-dtype takes
KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3", "kivi4", "kivi2")
KV_DTYPES = ("auto", "int8", "fp8", "kivi4", "kivi2")    # formats with a reference


def kv_format(name: str | None) -> KVFormat:
    """The format of a `kv_cache_dtype` option; ValueError naming the option."""
    key = _ALIASES.get(name or "auto", name or "auto")
    try:
        return KV_FORMATS[key]
    except KeyError:
        raise ValueError(f"kv_cache_dtype: unknown {name!r}; choose from "
                         f"{', '.join(KV_CACHE_DTYPES)}") from None


def kv_format_of(storage: torch.dtype) -> KVFormat:
    """The quantized format whose codes are stored as `storage`."""
    for fmt in KV_FORMATS.values():
        if fmt.storage == storage and fmt.per_token:
            return fmt
    raise ValueError(f"kv_cache_dtype: no quantized KV format stores {storage}")


def quantize_kv(x: torch.Tensor, fmt: KVFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [tokens, heads, dim] -> (codes [tokens, heads, dim] in fmt.storage,
    scale [tokens, heads] fp32), x ~= codes * scale."""
    xf = x.float()
    scale = (xf.abs().amax(-1) / fmt.qmax).clamp_min(1e-10)
    y = xf / scale[..., None]
    if fmt.storage == torch.int8:
        q = (torch.sign(y) * torch.floor(y.abs() + 0.5)).clamp(-127, 127).to(torch.int8)
    else:
        q = y.clamp(-fmt.qmax, fmt.qmax).to(fmt.storage)
    return q, scale


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes [..., dim] and scale [...] -> values [..., dim] in `dtype`."""
    return (q.float() * scale[..., None]).to(dtype)


def quantize_kv_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [tokens, heads, dim] -> (int8 [tokens, heads, dim], scale [tokens, heads] fp32)."""
    return quantize_kv(x, KV_FORMATS["int8"])


def dequantize_kv_int8(q: torch.Tensor, scale: torch.Tensor,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return dequantize_kv(q, scale, dtype)


def quantize_kv_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [tokens, heads, dim] -> (float8_e4m3fn, scale [tokens, heads] fp32)."""
    return quantize_kv(x, KV_FORMATS["fp8"])


def dequantize_kv_fp8(q: torch.Tensor, scale: torch.Tensor,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return dequantize_kv(q, scale, dtype)


def kivi_fake_quantize(k: torch.Tensor, v: torch.Tensor, bits: int, group: int = 32,
                       residual: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """KIVI on one sequence (see quant/kivi.py, the format's reference)."""
    from slipstream.quant.kivi import kivi_fake_quantize as fake
    return fake(k, v, bits, group, residual)


def fake_quantize_kv(x: torch.Tensor, kv_dtype: str) -> torch.Tensor:
    """Per-token formats only (int8, fp8): x [tokens, heads, dim] as a cache returns it."""
    if kv_dtype not in KV_CACHE_DTYPES or kv_dtype.startswith("kivi"):
        raise ValueError(f"kv_cache_dtype: expected one of auto, int8, fp8 here, got {kv_dtype!r}")
    fmt = kv_format(kv_dtype)
    if not fmt.quantized:
        return x
    return dequantize_kv(*quantize_kv(x, fmt), x.dtype)


def kv_bytes_per_token_head(head_dim: int, kv_dtype: str, model_bytes: int = 2) -> float:
    """Storage per token and KV head for K or V, scales included."""
    if kv_dtype.startswith("kivi"):
        bits = int(kv_dtype[4:])
        return head_dim * bits / 8 + 2 * 2 * head_dim / 32   # fp16 scale+zero per channel/group
    fmt = kv_format(kv_dtype)
    if fmt.quantized:
        return head_dim * fmt.storage.itemsize + 4          # codes + one fp32 scale
    return head_dim * model_bytes

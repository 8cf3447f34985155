"""Uniform quantization: integer codes, scales and zero points; fp8; packing; error statistics.

A weight matrix w [rows, cols] (rows = output channels) is split into groups
that share one (scale, zero):

    granularity "tensor":  one group, the whole matrix       scale [1, 1]
    granularity "channel": one group per row                 scale [rows, 1]
    granularity "group":   `group_size` consecutive columns  scale [rows, ceil(cols / group_size)]
                           (the last group is narrower when group_size does not divide cols)

Codes are always stored unsigned, in [0, 2^bits - 1], and dequantize as
(code - zero) * scale. Asymmetric quantization picks the zero per group
(z = round(-min / s)); symmetric fixes it at 2^(bits-1), so the signed value
code - zero lies in [-2^(bits-1), 2^(bits-1) - 1] and s = max|w| / (2^(bits-1) - 1)
(the largest magnitude is representable exactly; the chapter's s = 2 max|w| / (2^b - 1)
is half a step wider and clips it). Storing one unsigned form keeps a single
dequantization rule for every kernel.

`clip` < 1 shrinks the range before computing the scale: the values outside
are clipped (clipping error) while the rest get a finer step (rounding error
s^2 / 12); `search_clip` picks the ratio with the lowest total MSE.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_E4M3_MAX = 448.0
GRANULARITIES = ("tensor", "channel", "group")


@dataclass
class QTensor:
    """A quantized matrix: dequantized = (codes - zero) * scale, per group."""
    codes: torch.Tensor   # [rows, cols] uint8, in [0, 2^bits - 1]
    scale: torch.Tensor   # [rows or 1, num_groups] float32
    zero: torch.Tensor    # [rows or 1, num_groups] float32 (integer-valued)
    bits: int
    group_cols: int       # columns sharing one scale along a row

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_codes(self.codes, self.scale, self.zero, self.group_cols).to(dtype)


def check_bits(bits: int) -> None:
    if bits not in (2, 3, 4, 8):
        raise ValueError(f"bits: expected 2, 3, 4 or 8, got {bits!r}")


def _grouped(w: torch.Tensor, granularity: str, group_size: int) -> tuple[torch.Tensor, int]:
    """w [rows, cols] -> [rows or 1, num_groups, group_cols] view, and group_cols."""
    rows, cols = w.shape
    if granularity == "tensor":
        return w.reshape(1, 1, rows * cols), cols
    if granularity == "channel":
        return w.reshape(rows, 1, cols), cols
    if granularity == "group":
        if group_size <= 0:
            raise ValueError(f"group_size: expected a positive number, got {group_size}")
        pad = -cols % group_size
        if pad:   # zeros leave every group's range unchanged: the range always includes 0
            w = torch.nn.functional.pad(w, (0, pad))
        return w.reshape(rows, (cols + pad) // group_size, group_size), group_size
    raise ValueError(f"granularity: expected one of {GRANULARITIES}, got {granularity!r}")


def compute_qparams(w: torch.Tensor, bits: int, sym: bool = True, granularity: str = "group",
                    group_size: int = 128, clip: float | torch.Tensor = 1.0
                    ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Scales and zeros of w [rows, cols] -> (scale, zero) [rows or 1, num_groups], group_cols.

    `clip` may be a scalar or a tensor broadcastable to [rows or 1, num_groups]."""
    check_bits(bits)
    g, group_cols = _grouped(w.float(), granularity, group_size)
    if sym:
        qmax = 2 ** (bits - 1) - 1
        amax = g.abs().amax(-1) * clip
        scale = (amax / qmax).clamp_min(1e-10)
        zero = torch.full_like(scale, 2.0 ** (bits - 1))
    else:
        qmax = 2 ** bits - 1
        lo = g.amin(-1).clamp_max(0) * clip
        hi = g.amax(-1).clamp_min(0) * clip
        scale = ((hi - lo) / qmax).clamp_min(1e-10)
        zero = torch.round(-lo / scale).clamp(0, qmax)
    return scale, zero, group_cols


def _expand(p: torch.Tensor, rows: int, cols: int, group_cols: int) -> torch.Tensor:
    """[rows or 1, num_groups] -> [rows, cols], each group's value repeated."""
    if p.shape[0] == 1 and p.shape[1] == 1:   # per-tensor
        return p.expand(rows, cols)
    return p.repeat_interleave(group_cols, dim=1)[:, :cols].expand(rows, cols)


def quantize_codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
                   group_cols: int | None = None) -> torch.Tensor:
    """Codes of w [rows, cols] given per-group (scale, zero) -> uint8 [rows, cols].

    With group_cols None, scale/zero broadcast against w as they are (e.g. [rows, 1])."""
    if group_cols is not None:
        scale = _expand(scale, *w.shape, group_cols)
        zero = _expand(zero, *w.shape, group_cols)
    q = torch.round(w.float() / scale + zero).clamp(0, 2 ** bits - 1)
    return q.to(torch.uint8)


def dequantize_codes(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                     group_cols: int) -> torch.Tensor:
    rows, cols = codes.shape
    if scale.shape[0] == 1 and scale.shape[1] == 1:   # per-tensor
        return (codes.float() - zero) * scale
    groups = scale.shape[1]
    pad = groups * group_cols - cols
    c = torch.nn.functional.pad(codes, (0, pad)) if pad else codes
    w = (c.view(rows, groups, group_cols).float() - zero[..., None]) * scale[..., None]
    return w.view(rows, groups * group_cols)[:, :cols]


def quantize(w: torch.Tensor, bits: int, sym: bool = True, granularity: str = "group",
             group_size: int = 128, clip: float | torch.Tensor = 1.0) -> QTensor:
    """Round-to-nearest quantization of w [rows, cols]."""
    if w.dim() != 2:
        raise ValueError(f"quantize: expected a 2-D weight, got shape {tuple(w.shape)}")
    scale, zero, group_cols = compute_qparams(w, bits, sym, granularity, group_size, clip)
    return QTensor(quantize_codes(w, scale, zero, bits, group_cols), scale, zero, bits, group_cols)


def fake_quantize(w: torch.Tensor, bits: int, sym: bool = True, granularity: str = "group",
                  group_size: int = 128, clip: float | torch.Tensor = 1.0) -> torch.Tensor:
    """quantize then dequantize, in w's dtype."""
    return quantize(w, bits, sym, granularity, group_size, clip).dequantize(w.dtype)


# ---- error statistics ------------------------------------------------------

def mse(w: torch.Tensor, w_hat: torch.Tensor) -> float:
    return (w.float() - w_hat.float()).pow(2).mean().item()


def sqnr_db(w: torch.Tensor, w_hat: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB."""
    noise = (w.float() - w_hat.float()).pow(2).sum().clamp_min(1e-30)
    return (10 * torch.log10(w.float().pow(2).sum() / noise)).item()


def error_breakdown(w: torch.Tensor, qt: QTensor) -> dict[str, float]:
    """The chapter's MSE = clipping error + rounding error, measured.

    clip_mse: the part from values outside the representable range;
    round_mse: the part from values inside it (about s^2 / 12 each);
    clipped_fraction: the share of values clipped."""
    rows, cols = w.shape
    scale = _expand(qt.scale, rows, cols, qt.group_cols)
    zero = _expand(qt.zero, rows, cols, qt.group_cols)
    exact = w.float() / scale + zero
    clipped = (exact < -0.5) | (exact > 2 ** qt.bits - 0.5)
    err = (w.float() - qt.dequantize()).pow(2)
    n = w.numel()
    return {"mse": err.sum().item() / n,
            "clip_mse": err[clipped].sum().item() / n,
            "round_mse": err[~clipped].sum().item() / n,
            "clipped_fraction": clipped.float().mean().item(),
            "uniform_noise_mse": (scale.pow(2) / 12)[~clipped].sum().item() / n}


def search_clip(w: torch.Tensor, bits: int, sym: bool = True, granularity: str = "group",
                group_size: int = 128, grid: int = 20, min_ratio: float = 0.5) -> torch.Tensor:
    """Per-group clip ratio in [min_ratio, 1] minimizing that group's MSE -> [rows or 1, groups]."""
    g, _ = _grouped(w.float(), granularity, group_size)
    best_err = torch.full(g.shape[:2], float("inf"))
    best = torch.ones(g.shape[:2])
    for i in range(grid + 1):
        ratio = 1.0 - (1.0 - min_ratio) * i / grid
        w_hat = fake_quantize(w.float(), bits, sym, granularity, group_size, ratio)
        err = (_grouped(w_hat, granularity, group_size)[0] - g).pow(2).sum(-1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better, torch.full_like(best, ratio), best)
    return best


# ---- packing ---------------------------------------------------------------

def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [rows, cols] in [0, 15] -> uint8 [rows, cols // 2]: column 2i in the
    low nibble, column 2i + 1 in the high nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_int4: the column count {codes.shape[-1]} must be even")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [rows, cols // 2] -> uint8 codes [rows, cols]."""
    lo, hi = packed & 0xF, packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def pack_int2(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [rows, cols] in [0, 3] -> uint8 [rows, cols // 4], column 4i + j at bits 2j."""
    if codes.shape[-1] % 4:
        raise ValueError(f"pack_int2: the column count {codes.shape[-1]} must divide by 4")
    c = codes.to(torch.uint8)
    return c[..., 0::4] | (c[..., 1::4] << 2) | (c[..., 2::4] << 4) | (c[..., 3::4] << 6)


def unpack_int2(packed: torch.Tensor) -> torch.Tensor:
    parts = [(packed >> (2 * j)) & 0x3 for j in range(4)]
    return torch.stack(parts, dim=-1).flatten(-2)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Storage form of codes: 8 bits as is, 4 and 3 bits two per byte (3-bit codes take a
    nibble: no 3-bit packing), 2 bits four per byte."""
    check_bits(bits)
    if bits == 8:
        return codes.to(torch.uint8)
    return pack_int2(codes) if bits == 2 else pack_int4(codes)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 8:
        return packed
    return unpack_int2(packed) if bits == 2 else unpack_int4(packed)


def packed_cols(cols: int, bits: int) -> int:
    return cols if bits == 8 else (cols // 4 if bits == 2 else cols // 2)


# ---- per-row dynamic quantization (activations) and fp8 --------------------

def quantize_int8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row: x [n, k] -> (int8 [n, k], scale [n, 1] fp32)."""
    scale = (x.float().abs().amax(-1, keepdim=True) / 127.0).clamp_min(1e-10)
    q = torch.round(x.float() / scale).clamp(-127, 127).to(torch.int8)
    return q, scale


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float8 e4m3 per row: x [n, k] -> (float8_e4m3fn [n, k], scale [n, 1] fp32); each
    row's largest magnitude maps to 448, e4m3's largest finite value."""
    scale = (x.float().abs().amax(-1, keepdim=True) / FP8_E4M3_MAX).clamp_min(1e-12)
    q = (x.float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale

"""Quantized GEMMs: weight-only int4/int8 (dequantize in registers); the W8A8 GEMM is
kernels/w8a8_gemm.py.

int_weight_gemm: y[m, n] = sum_k x[m, k] * (code[n, k] - zero[n, g]) * scale[n, g],
g = k // GROUP. The weight streams from memory as packed codes (4 bits: two per byte,
column 2i in the low nibble) and is dequantized in registers, so a decode step reads
a quarter of the bytes of bf16 weights. The K loop steps BLOCK_K columns, a divisor of
the group, so one tile has one (scale, zero) per output row: the tile's product runs on
the centred codes (code - zero, exact in fp16/bf16) and is scaled once per tile,
acc += dot(x, (code - zero)^T) * scale[n].

Plain-PyTorch twin: reference.int_weight_linear.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from slipstream.kernels import quant_tuning
from slipstream.kernels.int_weight_gemv import (MAX_ROWS, default_gemv_config, dequantize_tiled,
                                                int_weight_gemv)
from slipstream.kernels import runtime  # noqa: F401  (interpreter fixes for CPU tests)
from slipstream.kernels.quant_tuning import default_config, int_weight_candidates, split_k_for


@triton.jit
def _grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Program -> (row block, column block) in grouped order: GROUP_M row blocks
    share each weight column block while it is in L2."""
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * grid_n
    first_m = (pid // width) * GROUP_M
    size_m = min(grid_m - first_m, GROUP_M)
    return first_m + (pid % width) % size_m, (pid % width) // size_m


@triton.jit
def _centred_weights(codes, z, BITS: tl.constexpr, DT: tl.constexpr):
    """codes (uint8 [BN, BK], values < 2^BITS) and zero points z (fp32 [BN]) -> code - zero
    in DT, exactly, without integer-to-float conversions (they run at a quarter of the
    ALU rate and would bound a batch-1 GEMV): the code is OR-ed into the mantissa of a
    power of two (fp16 1024 + code, bf16 128 + code for 4 bits, fp32 2^23 + code), read as
    a float, and the zero point plus that power subtracted (exact: small integers)."""
    if DT == tl.float16:
        v = (codes.to(tl.int16) | 0x6400).to(tl.float16, bitcast=True)
        return v - (z + 1024.0).to(tl.float16)[:, None]
    elif DT == tl.bfloat16 and BITS == 4:
        v = (codes.to(tl.int16) | 0x4300).to(tl.bfloat16, bitcast=True)
        return v - (z + 128.0).to(tl.bfloat16)[:, None]
    else:
        v = (codes.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True)
        return (v - (z + 8388608.0)[:, None]).to(DT)


@triton.jit
def _int_weight_gemm_kernel(X, QW, Scales, Zeros, Y, M, N, K, num_groups,
                            stride_xm, stride_qn, stride_ym, split_k, group,
                            BITS: tl.constexpr, HAS_ZEROS: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                            TILED: tl.constexpr = False):
    pid_m, pid_n = _grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    split = tl.program_id(1)

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    rn64 = rn.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # Split-K (few output tiles, e.g. decode): program `split` takes a run of K tiles.
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, split_k)
    k_begin = split * per_split * BLOCK_K
    k_end = min(K, (split + 1) * per_split * BLOCK_K)
    for k0 in range(k_begin, k_end, BLOCK_K):
        g = k0 // group
        s = tl.load(Scales + rn64 * num_groups + g, mask=n_ok, other=0.0)
        if HAS_ZEROS:
            z = tl.load(Zeros + rn64 * num_groups + g, mask=n_ok, other=0).to(tl.float32)
        else:
            z = tl.full((BLOCK_N,), 2 ** (BITS - 1), tl.float32)
        if TILED:
            # int32 words in the tiled layout of kernels/int_weight_gemv.py, BLOCK_K = its
            # tile: code j of word i is input k0 + j * KP + i, so code j of the tile's words
            # meets the contiguous inputs [k0 + j * KP, k0 + (j + 1) * KP): one dot of depth
            # KP per code position, no reordering of the unpacked codes (KP >= 16, the
            # smallest dot depth: 128-wide tiles of 4-bit, 64-wide of 8-bit codes).
            PER: tl.constexpr = 32 // BITS
            KP: tl.constexpr = BLOCK_K // PER
            rw = k0 // PER + tl.arange(0, KP)
            words = tl.load(QW + rn64[:, None] * stride_qn + rw[None, :],
                            mask=n_ok[:, None], other=0).to(tl.uint32, bitcast=True)
            if KP >= 16:
                tile = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for j in tl.static_range(PER):
                    rk = k0 + j * KP + tl.arange(0, KP)
                    x = tl.load(X + rm[:, None].to(tl.int64) * stride_xm + rk[None, :],
                                mask=m_ok[:, None], other=0.0)
                    codes = (words >> (j * BITS)) & ((1 << BITS) - 1)
                    w = _centred_weights(codes, z, BITS, X.dtype.element_ty)
                    tile = tl.dot(x, tl.trans(w), tile)
                acc += tile * s[None, :]
            else:   # dots need a depth of 16: unpack [BN, PER, KP] into input order instead
                rk = k0 + tl.arange(0, BLOCK_K)
                x = tl.load(X + rm[:, None].to(tl.int64) * stride_xm + rk[None, :],
                            mask=m_ok[:, None], other=0.0)
                shifts = (tl.arange(0, PER) * BITS).to(tl.uint32)
                codes = (words[:, None, :] >> shifts[None, :, None]) & ((1 << BITS) - 1)
                w = _centred_weights(tl.reshape(codes, (BLOCK_N, BLOCK_K)), z, BITS,
                                     X.dtype.element_ty)
                acc += tl.dot(x, tl.trans(w)) * s[None, :]
        else:
            rk = k0 + tl.arange(0, BLOCK_K)
            k_ok = rk < K
            x = tl.load(X + rm[:, None].to(tl.int64) * stride_xm + rk[None, :],
                        mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            if BITS == 4:
                rb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
                packed = tl.load(QW + rn64[:, None] * stride_qn + rb[None, :],
                                 mask=n_ok[:, None] & (rb < K // 2)[None, :], other=0)
                codes = tl.interleave(packed & 0xF, packed >> 4)   # [BLOCK_N, BLOCK_K]
            else:
                codes = tl.load(QW + rn64[:, None] * stride_qn + rk[None, :],
                                mask=n_ok[:, None] & k_ok[None, :], other=0)
            w = _centred_weights(codes, z, BITS, X.dtype.element_ty)
            acc += tl.dot(x, tl.trans(w)) * s[None, :]
    # With split_k > 1, Y is an fp32 workspace [split_k, M, N] summed by _sum_splits_kernel.
    Y += split.to(tl.int64) * M * stride_ym
    tl.store(Y + rm[:, None].to(tl.int64) * stride_ym + rn[None, :],
             acc.to(Y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _sum_splits_kernel(W, Y, total, split_k, BLOCK: tl.constexpr):
    """Y (flat, output dtype) = sum over the split_k fp32 partial results W [split_k, total]."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < total
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, split_k):
        acc += tl.load(W + s * total + offs, mask=ok, other=0.0)
    tl.store(Y + offs, acc.to(Y.dtype.element_ty), mask=ok)


DEQUANT_ROWS = 256      # from here on a product with a tiled weight dequantizes it for cuBLAS


def _k_block_limit(k: int, group: int) -> int:
    """The largest power-of-two BLOCK_K (16..128) that divides the group (tiles never
    straddle two groups); any when one group covers the row."""
    if group >= k:
        return 128
    for bk in (128, 64, 32, 16):
        if group % bk == 0:
            return bk
    raise ValueError(f"group_size: {group} must be a multiple of 16 for the Triton kernel")


def int_weight_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                    qzeros: torch.Tensor | None, bits: int, group_cols: int,
                    config: dict | None = None) -> torch.Tensor:
    """x: [m, k] fp16/bf16/fp32; qweight: uint8 [n, k // 2] (4 bits) or [n, k] (8 bits);
    scales: fp32 [n, ceil(k / group_cols)]; qzeros: uint8 like scales, or None (symmetric)
    -> y [m, n] in x's dtype. `config` fixes the launch (tests, sweeps); otherwise tuned."""
    if bits not in (4, 8):
        raise ValueError(f"bits: the Triton kernel takes 4 or 8, got {bits}")
    m, k = x.shape
    n = qweight.shape[0]
    assert qweight.dtype == torch.uint8 and qweight.shape[1] == (k // 2 if bits == 4 else k)
    assert scales.shape[0] == n and scales.dtype == torch.float32
    assert x.stride(1) == 1 and qweight.stride(1) == 1 and scales.is_contiguous()
    assert qzeros is None or (qzeros.shape == scales.shape and qzeros.is_contiguous())
    if m == 0:
        return torch.empty(m, n, dtype=x.dtype, device=x.device)
    limit = _k_block_limit(k, group_cols)
    if config is None:

        def timed_calls(cfg, copies):
            return [lambda w=w: _launch_int_weight(x, *w, bits, group_cols, cfg) for w in copies]
        config = quant_tuning.choose(
            ("int_weight", n, k, bits, group_cols, qzeros is not None, x.dtype), m, x.device,
            default_config(m, limit), lambda: int_weight_candidates(m, n, k, limit, x.device),
            (qweight, scales, qzeros), timed_calls)
    return _launch_int_weight(x, qweight, scales, qzeros, bits, group_cols, config)


def tiled_int_weight_gemm(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor,
                          qzeros: torch.Tensor | None, bits: int, group_cols: int,
                          tile: int, descriptors: dict | None = None) -> torch.Tensor:
    """The product with weights in the tiled word layout of kernels/int_weight_gemv.py
    (int32 [n, k * bits // 32]), by batch size: up to MAX_ROWS rows the weight-streaming
    GEMV (at one row of an 8-bit per-channel layer on sm_90, opt-in, also the TMA GEMV
    of kernels/tma_int8_gemv.py: `tma_int8_fits`; its TMA descriptors are kept in
    `descriptors`, tma_gemv.descriptors_of the layer); from DEQUANT_ROWS rows the
    weight dequantized once and multiplied by cuBLAS (compute-bound: the dequantization
    is a few percent of the product); between, the tensor-core kernel above unpacking
    the tiled words. Launches tuned like the others."""
    m, k = x.shape
    n = words.shape[0]
    if m <= MAX_ROWS:
        tma = m == 1 and tma_int8_fits(x, words, bits, group_cols, tile)

        def gemv(cfg, w, desc):
            if cfg.get("TMA"):
                return _tma_int8(x, w, cfg, desc)
            return int_weight_gemv(x, *w, bits, group_cols, tile, cfg)

        def gemv_calls(cfg, copies):
            return [lambda w=w: gemv(cfg, w, descriptors if w[0] is words else None)
                    for w in copies]
        cfg = quant_tuning.choose(
            ("int_gemv", n, k, bits, group_cols, qzeros is not None, x.dtype, tma), m, x.device,
            default_gemv_config(m, n, k, tile, x.device),
            lambda: quant_tuning.gemv_candidates(n, k, tile, x.device)
            + (quant_tuning.tma_int8_candidates() if tma else []),
            (words, scales, qzeros), gemv_calls)
        return gemv(cfg, (words, scales, qzeros), descriptors)
    if m >= DEQUANT_ROWS:
        w = dequantize_tiled(words, scales, qzeros, bits, group_cols, tile, x.dtype)
        return torch.nn.functional.linear(x, w)

    def timed_calls(cfg, copies):
        return [lambda w=w: _launch_int_weight(x, *w, bits, group_cols, cfg, tile) for w in copies]
    config = quant_tuning.choose(
        ("int_weight_tiled", n, k, bits, group_cols, qzeros is not None, x.dtype), m, x.device,
        dict(default_config(m, tile), BLOCK_K=tile),
        lambda: [dict(c, BLOCK_K=tile) for c in int_weight_candidates(m, n, k, tile, x.device)],
        (words, scales, qzeros), timed_calls)
    return _launch_int_weight(x, words, scales, qzeros, bits, group_cols, config, tile)


def tma_int8_fits(x: torch.Tensor, words: torch.Tensor, bits: int, group_cols: int,
                  tile: int) -> bool:
    """Whether the TMA GEMV (kernels/tma_int8_gemv.py) is weighed for this product: one
    16-bit row on an sm_90 GPU (compiled kernels), 8-bit codes in 128-input tiles, one
    group a row, and SLIPSTREAM_TMA_INT8_GEMV=1. Off by default: the tuner, timing each
    launch alone, picked it for some of Llama-3-8B's products, and int8 decode through
    the engine went from 1.40x to 1.33x bf16 (H200, benchmarks/quant/README.md)."""
    if os.environ.get("SLIPSTREAM_TMA_INT8_GEMV", "0") in ("", "0"):
        return False
    if not (x.is_cuda and x.shape[0] == 1 and x.dtype in (torch.bfloat16, torch.float16)
            and bits == 8 and tile == 128 and group_cols >= x.shape[1]):
        return False
    from slipstream.kernels.runtime import capability, interpreting
    from slipstream.kernels.tma_int8_gemv import K_MAX
    return (not interpreting() and capability(x.device.index or 0)[0] == 9
            and x.shape[1] <= K_MAX and words.is_contiguous() and words.data_ptr() % 16 == 0)


def _tma_int8(x, weights, cfg, descriptors):
    from slipstream.kernels.runtime import pdl_supported
    from slipstream.kernels.tma_int8_gemv import tma_int8_gemv
    words, scales, zeros = weights
    return tma_int8_gemv(x, words, scales, zeros, chain=pdl_supported(x), config=cfg,
                         descriptors=descriptors)


def w4_mma_product(x: torch.Tensor, p) -> torch.Tensor:
    """The product with a weight packed for the tensor-core 4-bit kernels (a W4Mma of
    kernels/w4_mma_gemv.py), tuned per token-count bucket like the others: up to its
    MAX_ROWS rows the GEMV; from 9 rows on sm_90 also the warpgroup kernel
    (w4_wgmma_gemm.py, up to its WG_MAX_ROWS), and from 16 rows the weight dequantized for cuBLAS; beyond those
    limits always the latter."""
    from slipstream.kernels import w4_mma_gemv as w4
    from slipstream.kernels import w4_wgmma_gemm as wgk
    m = x.shape[0]

    def call(cfg, q):
        if cfg.get("DEQUANT"):
            return torch.nn.functional.linear(x, w4.dequantize_w4_mma(q, x.dtype))
        if cfg.get("WG"):
            return wgk.w4_wgmma_gemm(x, q, cfg)
        return w4.w4_mma_gemv(x, q, cfg)
    wg = wgk.wgmma_supported(x)
    if m > (wgk.WG_MAX_ROWS if wg else w4.MAX_ROWS):
        return call({"DEQUANT": True}, p)
    from slipstream.kernels.runtime import num_sms
    default = w4.default_config(p, m, num_sms(x.device.index or 0))
    if m > w4.MAX_ROWS:
        default = dict(default, WG=True)

    def timed_calls(cfg, copies):
        return [lambda c=c: call(cfg, w4.W4Mma(*c, p.n, p.k)) for c in copies]
    cfg = quant_tuning.choose(("w4_mma", p.n, p.k, x.dtype), m, x.device, default,
                              lambda: quant_tuning.w4_mma_candidates(default, p.k, m, wg),
                              (p.words, p.scales, p.zeros), timed_calls)
    return call(cfg, p)


def _launch_int_weight(x, qweight, scales, qzeros, bits, group_cols, config, tile=None):
    m, k = x.shape
    n = qweight.shape[0]
    cfg = dict(config)
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    split = cfg.pop("SPLIT_K", None)
    if split is None:
        split = split_k_for(tiles, triton.cdiv(k, cfg["BLOCK_K"]), x.device)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    out = y if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    _int_weight_gemm_kernel[(tiles, split)](
        x, qweight, scales, qzeros if qzeros is not None else scales, out, m, n, k,
        scales.shape[1], x.stride(0), qweight.stride(0), n, split, group_cols,
        BITS=bits, HAS_ZEROS=qzeros is not None, GROUP_M=8, TILED=tile is not None, **cfg)
    if split > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](out, y, m * n, split, BLOCK=block,
                                                         num_warps=4)
    return y

"""Quantized GEMMs: weight-only int4/int8 (dequantize in registers) and int8 W8A8.

int_weight_gemm: y[m, n] = sum_k x[m, k] * (code[n, k] - zero[n, g]) * scale[n, g],
g = k // GROUP. The weight streams from memory as packed codes (4 bits: two per byte,
column 2i in the low nibble) and is dequantized in registers, so a decode step reads
a quarter of the bytes of bf16 weights. The K loop steps BLOCK_K columns, a divisor of
the group, so one tile has one (scale, zero) per output row: the tile's product runs on
the centred codes (code - zero, exact in fp16/bf16) and is scaled once per tile,
acc += dot(x, (code - zero)^T) * scale[n].

w8a8_gemm: int8 x int8 tiles accumulated in int32 (exact), then
y = acc * x_scale[m] * w_scale[n] in the output dtype.

Plain-PyTorch twins: reference.int_weight_linear and reference.w8a8_linear.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from slipstream.kernels import runtime  # noqa: F401  (interpreter fixes for CPU tests)


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
def _int_weight_gemm_kernel(X, QW, Scales, Zeros, Y, M, N, K, num_groups,
                            stride_xm, stride_qn, stride_ym,
                            BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                            SPLIT_K: tl.constexpr):
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
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    k_begin = split * per_split * BLOCK_K
    k_end = min(K, (split + 1) * per_split * BLOCK_K)
    for k0 in range(k_begin, k_end, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = tl.load(X + rm[:, None].to(tl.int64) * stride_xm + rk[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if BITS == 4:
            rb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            packed = tl.load(QW + rn64[:, None] * stride_qn + rb[None, :],
                             mask=n_ok[:, None] & (rb < K // 2)[None, :], other=0)
            lo = packed & 0xF
            hi = (packed >> 4) & 0xF
            codes = tl.interleave(lo, hi)                    # [BLOCK_N, BLOCK_K]
        else:
            codes = tl.load(QW + rn64[:, None] * stride_qn + rk[None, :],
                            mask=n_ok[:, None] & k_ok[None, :], other=0)
        g = k0 // GROUP
        s = tl.load(Scales + rn64 * num_groups + g, mask=n_ok, other=0.0)
        if HAS_ZEROS:
            z = tl.load(Zeros + rn64 * num_groups + g, mask=n_ok, other=0).to(tl.float32)
        else:
            z = tl.full((BLOCK_N,), 2 ** (BITS - 1), tl.float32)
        w = (codes.to(tl.float32) - z[:, None]).to(x.dtype)  # exact: |code - zero| < 256
        acc += tl.dot(x, tl.trans(w)) * s[None, :]
    # With SPLIT_K > 1, Y is an fp32 workspace [SPLIT_K, M, N] summed by the launcher.
    Y += split.to(tl.int64) * M * stride_ym
    tl.store(Y + rm[:, None].to(tl.int64) * stride_ym + rn[None, :],
             acc.to(Y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _w8a8_gemm_kernel(XQ, XS, WQ, WS, Y, M, N, K, stride_xm, stride_wn, stride_ym,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      GROUP_M: tl.constexpr):
    pid_m, pid_n = _grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        a = tl.load(XQ + rm[:, None].to(tl.int64) * stride_xm + rk[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0)
        b = tl.load(WQ + rn[:, None].to(tl.int64) * stride_wn + rk[None, :],
                    mask=n_ok[:, None] & k_ok[None, :], other=0)
        acc += tl.dot(a, tl.trans(b), out_dtype=tl.int32)
    xs = tl.load(XS + rm, mask=m_ok, other=0.0)
    ws = tl.load(WS + rn, mask=n_ok, other=0.0)
    y = acc.to(tl.float32) * xs[:, None] * ws[None, :]
    tl.store(Y + rm[:, None].to(tl.int64) * stride_ym + rn[None, :],
             y.to(Y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# ---- tuning: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) by token count --------------

def default_config(m: int, k_block_limit: int) -> dict:
    """Decode-sized M: thin row tiles, wide K steps (a GEMV streaming the weight);
    prefill-sized M: square tensor-core tiles."""
    bk = min(128, k_block_limit)
    if m <= 16:
        cfg = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=bk, num_warps=4, num_stages=4)
    elif m <= 64:
        cfg = dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=bk, num_warps=4, num_stages=4)
    else:
        cfg = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=min(64, bk), num_warps=8, num_stages=3)
    return cfg


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
    -> y [m, n] in x's dtype."""
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
    cfg = dict(config or default_config(m, _k_block_limit(k, group_cols)))
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    split = cfg.pop("SPLIT_K", None)
    if split is None:
        split = split_k_for(tiles, triton.cdiv(k, cfg["BLOCK_K"]), x.device)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device) if split == 1 else \
        torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    _int_weight_gemm_kernel[(tiles, split)](
        x, qweight, scales, qzeros if qzeros is not None else scales, y, m, n, k,
        scales.shape[1], x.stride(0), qweight.stride(0), n,
        BITS=bits, GROUP=group_cols, HAS_ZEROS=qzeros is not None, GROUP_M=8, SPLIT_K=split,
        **cfg)
    return y if split == 1 else y.sum(0).to(x.dtype)


def split_k_for(tiles: int, k_tiles: int, device: torch.device) -> int:
    """Split K when the output tiles alone cannot fill the GPU: aim at two programs per SM,
    keeping at least 4 K tiles per program. Always 1 off CUDA."""
    if device.type != "cuda" or tiles >= 132:
        return 1
    from slipstream.kernels.runtime import num_sms
    want = -(-2 * num_sms(device.index or 0) // tiles)
    return max(1, min(want, k_tiles // 4, 16))


def w8a8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
              out_dtype: torch.dtype, config: dict | None = None) -> torch.Tensor:
    """xq: int8 [m, k]; x_scale: fp32 [m, 1]; wq: int8 [n, k]; w_scale: fp32 [n]
    -> [m, n] out_dtype."""
    m, k = xq.shape
    n = wq.shape[0]
    assert xq.dtype == torch.int8 and wq.dtype == torch.int8 and wq.shape[1] == k
    assert xq.stride(1) == 1 and wq.stride(1) == 1
    y = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if m == 0:
        return y
    cfg = dict(config or default_config(m, 128))
    if config is None and m > 64:
        cfg["BLOCK_K"] = 128
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    _w8a8_gemm_kernel[grid](xq, x_scale.reshape(-1).contiguous(), wq, w_scale.contiguous(), y,
                            m, n, k, xq.stride(0), wq.stride(0), y.stride(0), GROUP_M=8, **cfg)
    return y

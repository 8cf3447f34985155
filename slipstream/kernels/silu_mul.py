"""SwiGLU's gate in one kernel: silu(gate) * up from the fused gate_up output.

The torch twin (`reference.silu_and_mul`) runs F.silu then a multiply, each
rounded to the model dtype; this kernel rounds at the same two points, so in
bf16 it differs from the twin only by the order of fp32 operations. The grid
depends only on the shape (CUDA-graph safe).

`silu_and_mul_quant` feeds a W8A8 down projection: one program per row computes the
product (rounded to the model dtype as above) and its largest magnitude over the row,
then recomputes it and writes int8 / float8 codes and the row's scale, so the bf16
product never goes to memory and the separate quantization kernel is gone. Its codes
equal quantize_rows(silu_and_mul(x)). Measured on an H200 (M=2048, d=14336) it is no
faster than the product then quantize_rows (80 us): the second read of the row misses
the cache. `SLIPSTREAM_SILU_QUANT=onepass` holds the whole row in registers instead
(rows up to 16,384 wide; no register spills at 16 warps for sm_90), one read of the
input; not measured yet, so opt-in.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from slipstream.kernels.quant_act import empty_rows, quant_params, quantize_block, row_scale
from slipstream.kernels.runtime import pdl_elementwise


@triton.jit
def _silu_mul_kernel(X, Out, stride_x, stride_o, D: tl.constexpr, BLOCK: tl.constexpr,
                     PDL: tl.constexpr):
    if PDL:   # launched early: x is the kernel ahead's output
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    g = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(X + row * stride_x + D + cols, mask=mask, other=0.0).to(tl.float32)
    act = (g * tl.sigmoid(g)).to(Out.dtype.element_ty).to(tl.float32)
    tl.store(Out + row * stride_o + cols, (act * u).to(Out.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, 2 * d] = [gate | up] -> [num_tokens, d]"""
    assert x.ndim == 2 and x.stride(1) == 1 and x.shape[1] % 2 == 0
    num_tokens, d = x.shape[0], x.shape[1] // 2
    out = torch.empty((num_tokens, d), dtype=x.dtype, device=x.device)
    if num_tokens > 0:
        block = min(1024, triton.next_power_of_2(d))
        _silu_mul_kernel[(num_tokens, triton.cdiv(d, block))](
            x, out, x.stride(0), out.stride(0), D=d, BLOCK=block,
            PDL=(pdl := pdl_elementwise(x)), launch_pdl=pdl, num_warps=4)
    return out


@triton.jit
def _silu_mul_cols(x_row, cols, D, DT: tl.constexpr):
    """SiLU(gate) * up of the row's columns `cols` (past D: 0), rounded as the unquantized
    kernel rounds (the activation, then the product, in DT), in fp32."""
    mask = cols < D
    g = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_row + D + cols, mask=mask, other=0.0).to(tl.float32)
    act = (g * tl.sigmoid(g)).to(DT).to(tl.float32)
    return (act * u).to(DT).to(tl.float32)


@triton.jit
def _silu_mul_quant_kernel(X, Q, S, stride_x, stride_q, D, QMAX: tl.constexpr,
                           EPS: tl.constexpr, FP8: tl.constexpr, BLOCK: tl.constexpr,
                           ONE_PASS: tl.constexpr):
    DT = X.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    if ONE_PASS:     # BLOCK >= D: the whole row in registers, read once
        cols = tl.arange(0, BLOCK)
        mask = cols < D
        y = _silu_mul_cols(x_row, cols, D, DT)
        scale = row_scale(tl.max(tl.abs(y), axis=0), QMAX, EPS)
        tl.store(S + row, scale)
        tl.store(Q + row * stride_q + cols, quantize_block(y, scale, QMAX, FP8,
                                                           Q.dtype.element_ty), mask=mask)
    else:
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for c0 in range(0, D, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            amax = tl.maximum(amax, tl.abs(_silu_mul_cols(x_row, cols, D, DT)))
        scale = row_scale(tl.max(amax, axis=0), QMAX, EPS)
        tl.store(S + row, scale)
        for c0 in range(0, D, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            mask = cols < D
            y = _silu_mul_cols(x_row, cols, D, DT)
            tl.store(Q + row * stride_q + cols, quantize_block(y, scale, QMAX, FP8,
                                                               Q.dtype.element_ty), mask=mask)


ONE_PASS_MAX = 16384


def silu_and_mul_quant(x: torch.Tensor, kind: str,
                       one_pass: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [num_tokens, 2 * d] = [gate | up] -> (codes [num_tokens, d] int8 or float8_e4m3fn,
    scale [num_tokens, 1] fp32) of silu(gate) * up, quantized per token. kind: "int8"/"fp8".
    one_pass: the whole-row variant (None: SLIPSTREAM_SILU_QUANT=onepass; rows up to
    ONE_PASS_MAX wide)."""
    params = quant_params(kind)
    assert x.ndim == 2 and x.stride(1) == 1 and x.shape[1] % 2 == 0
    num_tokens, d = x.shape[0], x.shape[1] // 2
    q, s = empty_rows(num_tokens, d, kind, x.device)
    if one_pass is None:
        one_pass = os.environ.get("SLIPSTREAM_SILU_QUANT", "twopass") == "onepass"
    one_pass = one_pass and triton.next_power_of_2(d) <= ONE_PASS_MAX
    if num_tokens > 0:
        if one_pass:
            block = triton.next_power_of_2(d)
            warps = max(4, min(16, block // 512))
        else:
            block = min(2048, triton.next_power_of_2(d))
            warps = 4 if block <= 1024 else 8
        _silu_mul_quant_kernel[(num_tokens,)](x, q, s, x.stride(0), q.stride(0), d,
                                              BLOCK=block, ONE_PASS=one_pass,
                                              num_warps=warps, **params)
    return q, s

"""One Triton kernel for the FP8 Gluon prefill's inputs (gluon_fp8_inputs.quantize_fp8_inputs,
in PyTorch there, a dozen passes over each tensor): per block of tokens of one request and
one head, load, optionally rotate (x @ R on the tensor cores, tf32), take the block's
maximum, scale to e4m3 and store, V transposed (V^T [kv_heads * D, columns], each
request's columns from a multiple of 16: gluon_fp8_inputs.v_columns).
Each scale is stored per token [tokens, heads] fp32, as the PyTorch version does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from slipstream.kernels.fp8_attention import FP8, FP8_MAX, random_orthogonal
from slipstream.kernels.gluon_fp8_inputs import Fp8Inputs, v_columns


@triton.jit
def _quantize_blocks_kernel(X, R, Q, Scale, CuSeqlens, VStarts, heads, stride_xt, stride_xh, stride_q,
                            D: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr,
                            ROTATE: tl.constexpr, TRANSPOSE: tl.constexpr, KEY_PERM: tl.constexpr):
    """Program (block, head, request): tokens block*BLOCK.. of the request, scales per SUB.
    KEY_PERM (TRANSPOSE): each 16 tokens' columns in gluon_fp8_inputs.KEY_PERM_16 order."""
    mb = tl.program_id(0)
    h = tl.program_id(1)
    seq = tl.program_id(2)
    start = tl.load(CuSeqlens + seq)
    n = tl.load(CuSeqlens + seq + 1) - start
    if mb * BLOCK < n:
        rows = mb * BLOCK + tl.arange(0, BLOCK)
        cols = tl.arange(0, D)
        keep = rows < n
        tok = (start + rows).to(tl.int64)
        x = tl.load(X + tok[:, None] * stride_xt + h * stride_xh + cols[None, :], mask=keep[:, None],
                    other=0.0).to(tl.float32)
        if ROTATE:
            x = tl.dot(x, tl.load(R + cols[:, None] * D + cols[None, :]))
        amax = tl.max(tl.reshape(tl.max(tl.abs(x), axis=1), [BLOCK // SUB, SUB]), axis=1)
        scale = tl.maximum(amax / 448.0, 1e-12)
        row_scale = tl.reshape(tl.broadcast_to(scale[:, None], [BLOCK // SUB, SUB]), [BLOCK])
        q = tl.clamp(x / row_scale[:, None], -448.0, 448.0).to(tl.float8e4nv)
        if TRANSPOSE:  # Q is V^T [kv_heads * D, columns], the request's from VStarts[seq]
            # A request's columns start 16-aligned and run to its length rounded up to 16 (the
            # rows past its end store the zeros they loaded), so stores go 16 tokens at a time.
            col = tl.multiple_of(tl.load(VStarts + seq), 16) + rows
            n16 = tl.multiple_of((n + 15) // 16 * 16, 16)
            vq = q
            if KEY_PERM:  # column a holds token a0 + 8 a1 + 2 a2 + 4 a3 of its 16: rows reordered
                vq = tl.reshape(tl.permute(tl.reshape(q, [BLOCK // 16, 2, 2, 2, 2, D]), (0, 2, 3, 1, 4, 5)),
                                [BLOCK, D])
            tl.store(Q + (h * D + cols)[None, :].to(tl.int64) * stride_q + col[:, None], vq,
                     mask=(rows < n16)[:, None])
        else:
            tl.store(Q + tok[:, None] * stride_q + h * D + cols[None, :], q, mask=keep[:, None])
        tl.store(Scale + tok * heads + h, row_scale, mask=keep)


def _launch(x, out, scale, cu_seqlens, v_starts, max_seqlen, rot, block, sub, transpose, key_perm=False):
    tokens, heads, d = x.shape
    grid = (triton.cdiv(max_seqlen, block), heads, cu_seqlens.numel() - 1)
    _quantize_blocks_kernel[grid](x, rot if rot is not None else x, out, scale, cu_seqlens, v_starts, heads,
                                  x.stride(0), x.stride(1), out.stride(0), D=d, BLOCK=block, SUB=sub,
                                  ROTATE=rot is not None, TRANSPOSE=transpose, KEY_PERM=key_perm,
                                  num_warps=8)


def quantize_fp8_inputs_fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              cu_seqlens: torch.Tensor, max_seqlen: int, *, rotate: bool = True,
                              q_block: int = 64, kv_block: int = 128, key_perm: bool = False) -> Fp8Inputs:
    """quantize_fp8_inputs (full FP8) in three launches. q [tokens, heads, D], k / v
    [tokens, kv_heads, D] with D contiguous; max_seqlen: host int, the longest request.
    q_block must divide 128 (Q is read 128 tokens at a time); kv_block is 128; key_perm: V^T's
    tokens in the kernel's P operand order (gluon_fp8_inputs.KEY_PERM_16)."""
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape or q.shape[0] != k.shape[0] \
            or q.shape[2] != k.shape[2] or any(t.stride(2) != 1 for t in (q, k, v)):
        raise ValueError(f"q, k, v must be [tokens, heads, D] with D contiguous, k and v alike: "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if 128 % q_block or q_block < 16 or kv_block != 128:
        raise ValueError(f"q_block must divide 128 (>= 16) and kv_block be 128: {q_block}, {kv_block}")
    tokens, heads, d = q.shape
    kv_heads = k.shape[1]
    rot = random_orthogonal(d, q.device).contiguous() if rotate else None
    q8 = torch.empty(q.shape, dtype=FP8, device=q.device)
    k8 = torch.empty(k.shape, dtype=FP8, device=q.device)
    v_starts, v_cols, width = v_columns(cu_seqlens, tokens, key_perm)
    vt8 = torch.zeros(kv_heads * d, width, dtype=torch.uint8, device=q.device).view(FP8)
    q_scale = torch.empty(tokens, heads, dtype=torch.float32, device=q.device)
    k_scale = torch.empty(tokens, kv_heads, dtype=torch.float32, device=q.device)
    v_scale = torch.empty_like(k_scale)
    if max_seqlen > 0 and tokens:
        _launch(q, q8, q_scale, cu_seqlens, v_starts, max_seqlen, rot, 128, q_block, False)
        _launch(k, k8, k_scale, cu_seqlens, v_starts, max_seqlen, rot, 128, kv_block, False)
        _launch(v, vt8, v_scale, cu_seqlens, v_starts, max_seqlen, None, 128, kv_block, True, key_perm)
    return Fp8Inputs(q8, k8, vt8, q_scale, k_scale, v_scale, kv_block, v_starts, v_cols, key_perm)


assert FP8_MAX == 448.0  # the kernel's constant

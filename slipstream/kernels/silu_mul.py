"""SwiGLU's gate in one kernel: silu(gate) * up from the fused gate_up output.

The torch twin (`reference.silu_and_mul`) runs F.silu then a multiply, each
rounded to the model dtype; this kernel rounds at the same two points, so in
bf16 it differs from the twin only by the order of fp32 operations. The grid
depends only on the shape (CUDA-graph safe).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_mul_kernel(X, Out, stride_x, stride_o, D: tl.constexpr, BLOCK: tl.constexpr):
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
            x, out, x.stride(0), out.stride(0), D=d, BLOCK=block, num_warps=4)
    return out

"""FP8 path: the rotation and block quantiser, and the kernel against its twin
`reference.fp8_prefill_attention` (same rotation and quantisation, then exact
attention in fp32). Kernel tolerance: 4e-3 abs/rel (fp16 P.V; the fp8 rounding
is in both). The accuracy against bf16 is measured on the GPU in
benchmarks/attention, not asserted here.
"""
import pytest
import torch

from slipstream.kernels import reference
from slipstream.kernels.fp8_attention import (
    FP8_MAX, fp8_prefill_attention, quantize_fp8_blocks, random_orthogonal)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_rotation_is_orthogonal_and_fixed():
    r = random_orthogonal(64, "cpu")
    torch.testing.assert_close(r @ r.T, torch.eye(64), atol=1e-5, rtol=0)
    assert torch.equal(r, random_orthogonal(64, "cpu"))


def test_block_quantizer_shares_scales_within_a_request():
    cu = torch.tensor([0, 5, 30], dtype=torch.int32)
    x = torch.randn(30, 3, 16)
    x[7, 1, 2] = 40.0  # an outlier in request 1, block 0 (tokens 5..12)
    x8, scale = quantize_fp8_blocks(x, cu, block=8)
    # Blocks restart at each request: tokens 0-4 | 5-12 | 13-20 | 21-28 | 29.
    for lo, hi in [(0, 5), (5, 13), (13, 21), (21, 29), (29, 30)]:
        assert torch.all(scale[lo:hi] == scale[lo]), (lo, hi)
        torch.testing.assert_close(scale[lo], x[lo:hi].abs().amax((0, 2)) / FP8_MAX)
    assert scale[7, 1] > 10 * scale[13, 1]  # the outlier does not leak into other blocks
    err = (x8.float() * scale[..., None] - x).abs()
    assert torch.all(err <= x.abs() * 2 ** -3 + scale[..., None] * 2 ** -9)  # e4m3: 3 mantissa bits


@pytest.mark.parametrize("rotate", [False, True])
def test_fp8_kernel_matches_twin(close, rotate):
    cu = torch.tensor([0, 1, 38, 58], dtype=torch.int32, device=DEVICE)
    q = torch.randn(58, 4, 64, dtype=torch.float16, device=DEVICE)
    k = torch.randn(58, 2, 64, dtype=torch.float16, device=DEVICE)
    v = torch.randn(58, 2, 64, dtype=torch.float16, device=DEVICE)
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=DEVICE)
    fp8_prefill_attention(q, k, v, cu, 37, 0.125, rotate=rotate, quant_block=16, out=out)
    rot = random_orthogonal(64, DEVICE) if rotate else None
    ref = reference.fp8_prefill_attention(q, k, v, cu, 0.125, rot, quant_block=16)
    close(out, ref, 4e-3, 4e-3)

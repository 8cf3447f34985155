"""Quantized GEMM kernels against their PyTorch twins (reference.int_weight_linear,
reference.w8a8_linear), on random (never zero) inputs, fp16/fp32 under the interpreter.

Tolerances: the kernel and the twin multiply the same dequantized values; they differ only
in summation order and, for fp16, in rounding the product once per K tile instead of once:
atol/rtol 2e-2 (fp16, |y| ~ 10), 1e-4 (fp32). W8A8 accumulates exactly in int32 in both:
only the final scaling rounds (rtol 1e-3 fp16, 1e-5 fp32)."""
import pytest
import torch

from slipstream.kernels import reference
from slipstream.kernels.quant_gemm import int_weight_gemm, w8a8_gemm
from slipstream.quant.primitives import pack_codes, quantize, quantize_int8_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float16: 2e-2, torch.float32: 1e-4}


def _quantized(n, k, bits, group, sym):
    w = torch.randn(n, k) * 0.1
    qt = quantize(w, bits, sym, "group", group)
    return (pack_codes(qt.codes, bits), qt.scale.float().contiguous(),
            None if sym else qt.zero.to(torch.uint8).contiguous())


@pytest.mark.parametrize("m,n,k,bits,group,sym", [
    (1, 48, 128, 4, 32, False),     # decode row, N not a multiple of the block
    (5, 64, 96, 4, 32, True),       # K tail inside the last tile, symmetric (no zeros)
    (33, 80, 160, 4, 64, False),    # ragged last group (160 = 2 x 64 + 32)
    (3, 40, 64, 8, 64, True),       # int8 weights, per channel (one group per row)
    (20, 32, 128, 8, 32, False),
])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_int_weight_gemm_matches_reference(m, n, k, bits, group, sym, dtype):
    qw, s, z = _quantized(n, k, bits, group, sym)
    x = torch.randn(m, k, dtype=dtype)
    args = [t.to(DEVICE) if t is not None else None for t in (x, qw, s, z)]
    y = int_weight_gemm(*args, bits, group)
    ref = reference.int_weight_linear(x.float(), qw, s, z, bits, group)
    assert y.dtype == dtype and y.shape == (m, n)
    torch.testing.assert_close(y.float().cpu(), ref, atol=TOL[dtype], rtol=TOL[dtype])


def test_int_weight_gemm_prefill_config_and_bad_groups():
    qw, s, z = _quantized(32, 128, 4, 64, False)
    x = torch.randn(70, 128, dtype=torch.float16)
    cfg = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=2)
    y = int_weight_gemm(x.to(DEVICE), qw.to(DEVICE), s.to(DEVICE), z.to(DEVICE), 4, 64, cfg)
    ref = reference.int_weight_linear(x.float(), qw, s, z, 4, 64)
    torch.testing.assert_close(y.float().cpu(), ref, atol=2e-2, rtol=2e-2)
    # Split-K: partial sums in an fp32 workspace, added by the launcher.
    for split in (2, 3):
        y = int_weight_gemm(x[:3].to(DEVICE), qw.to(DEVICE), s.to(DEVICE), z.to(DEVICE), 4, 64,
                            dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=2,
                                 SPLIT_K=split))
        torch.testing.assert_close(y.float().cpu(), ref[:3], atol=2e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="group_size"):
        int_weight_gemm(x, qw, s, z, 4, 24)
    with pytest.raises(ValueError, match="bits"):
        int_weight_gemm(x, qw, s, z, 3, 64)


@pytest.mark.parametrize("m,n,k", [(1, 48, 64), (17, 40, 96), (70, 64, 160)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_w8a8_gemm_matches_reference(m, n, k, dtype):
    xq, xs = quantize_int8_rows(torch.randn(m, k))
    wq, ws = quantize_int8_rows(torch.randn(n, k))
    ws = ws.flatten()
    y = w8a8_gemm(xq.to(DEVICE), xs.to(DEVICE), wq.to(DEVICE), ws.to(DEVICE), dtype)
    ref = reference.w8a8_linear(xq, xs, wq, ws, torch.float32)
    rtol = 1e-3 if dtype == torch.float16 else 1e-5
    torch.testing.assert_close(y.float().cpu(), ref, atol=rtol, rtol=rtol)

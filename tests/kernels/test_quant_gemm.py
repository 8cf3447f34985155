"""Quantized GEMM kernels against their PyTorch twins (reference.int_weight_linear; the
W8A8 GEMM: test_w8a8_gemm.py), on random (never zero) inputs, fp16/fp32 under the interpreter.

Tolerances: the kernel and the twin multiply the same dequantized values; they differ only
in summation order and, for fp16, in rounding the product once per K tile instead of once:
atol/rtol 2e-2 (fp16, |y| ~ 10), 1e-4 (fp32). W8A8 accumulates exactly in int32 in both:
only the final scaling rounds (rtol 1e-3 fp16, 1e-5 fp32)."""
import pytest
import torch

from slipstream.kernels import reference
from slipstream.kernels.quant_gemm import int_weight_gemm
from slipstream.quant.primitives import pack_codes, quantize, quantize_int8_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# On a GPU tl.dot takes fp32 operands as TF32 (10-bit mantissa): fp16's tolerance.
TOL = {torch.float16: 2e-2, torch.float32: 1e-4 if DEVICE == "cpu" else 2e-2}


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


# ---- the exact dequantization trick and the activation-quantization kernel ----------------

import triton                        # noqa: E402
import triton.language as tl         # noqa: E402

from slipstream.kernels.quant_act import quantize_rows            # noqa: E402
from slipstream.kernels.quant_gemm import _centred_weights        # noqa: E402
from slipstream.quant.primitives import quantize_fp8_rows         # noqa: E402


@triton.jit
def _centred_probe(C, Z, Out, BITS: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
    rn = tl.arange(0, N)
    rk = tl.arange(0, K)
    codes = tl.load(C + rn[:, None] * K + rk[None, :])
    z = tl.load(Z + rn).to(tl.float32)
    tl.store(Out + rn[:, None] * K + rk[None, :],
             _centred_weights(codes, z, BITS, Out.dtype.element_ty))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_centred_weights_exact(bits, dtype):
    """code - zero by the float trick is exact in every dtype: every code, every zero."""
    if dtype == torch.bfloat16 and bits == 4 and DEVICE == "cpu":
        pytest.skip("Triton's interpreter cannot bitcast to bfloat16 (checked on CUDA and by "
                    "benchmarks/quant/bench_quant_gemm.py's correctness pass)")
    top = 2 ** bits
    codes = torch.arange(16 * 32).remainder(top).to(torch.uint8).view(16, 32)
    zeros = torch.randint(0, top, (16,), dtype=torch.uint8)
    out = torch.empty(16, 32, dtype=dtype)
    args = [t.to(DEVICE) for t in (codes, zeros, out)]
    _centred_probe[(1,)](*args, BITS=bits, N=16, K=32)
    want = codes.float() - zeros.float()[:, None]
    assert torch.equal(args[2].float().cpu(), want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_quantize_rows_int8_bit_identical(dtype):
    x = (torch.randn(6, 300) * 3).to(dtype)
    x[1] = 0                                             # an all-zero row: the scale floor
    x[2] = 0
    x[2, :6] = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 127.0]).to(dtype)   # ties: half to even
    q, s = quantize_rows(x.to(DEVICE), "int8")
    qr, sr = quantize_int8_rows(x)
    assert q.dtype == torch.int8 and s.shape == (6, 1)
    assert torch.equal(q.cpu(), qr) and torch.equal(s.cpu(), sr)
    with pytest.raises(ValueError, match="kind"):
        quantize_rows(x, "int4")


@pytest.mark.skipif(DEVICE != "cuda", reason="Triton's interpreter rounds float8 wrongly")
def test_quantize_rows_fp8_bit_identical():
    x = torch.randn(6, 300, device=DEVICE, dtype=torch.bfloat16) * 3
    q, s = quantize_rows(x, "fp8")
    # The twin on the CPU: on CUDA, PyTorch divides by a Python number as a product with
    # its reciprocal, which can miss the correctly rounded scale by an ulp.
    qr, sr = quantize_fp8_rows(x.cpu())
    assert torch.equal(q.view(torch.uint8).cpu(), qr.view(torch.uint8))
    assert torch.equal(s.cpu(), sr)

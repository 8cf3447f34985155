"""The tiled-word GEMV and dequantizer (kernels/int_weight_gemv.py) against the packed-code
twin reference.int_weight_linear, under the interpreter on the CPU (fp16/fp32) and on a GPU
in bf16 too.

Tolerances as in test_quant_gemm: the same dequantized values, summed in another order."""
import pytest
import torch

from slipstream.kernels import reference
from slipstream.kernels.int_weight_gemv import (dequantize_tiled, int_weight_gemv, pick_tile,
                                                tile_codes, untile_codes)
from slipstream.quant.primitives import pack_codes, quantize

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float16: 2e-2, torch.float32: 1e-4, torch.bfloat16: 5e-2}
DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def _quantized(n, k, bits, group, sym, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.1
    qt = quantize(w, bits, sym, "group", group)
    return (qt.codes.to(torch.uint8), pack_codes(qt.codes, bits), qt.scale.float().contiguous(),
            None if sym else qt.zero.to(torch.uint8).contiguous())


@pytest.mark.parametrize("bits,tile", [(4, 32), (4, 128), (8, 64)])
def test_tiled_layout_round_trip(bits, tile):
    codes = torch.randint(0, 2 ** bits, (6, 256), dtype=torch.uint8)
    words = tile_codes(codes, bits, tile)
    assert words.dtype == torch.int32 and words.shape == (6, 256 * bits // 32)
    assert torch.equal(untile_codes(words, bits, tile), codes)
    # Word i of tile 0 holds input j * KP + i as code j.
    kp = tile * bits // 32
    assert int(words[0, 1]) & (2 ** bits - 1) == int(codes[0, 1])
    assert (int(words[0, 1]) >> bits) & (2 ** bits - 1) == int(codes[0, kp + 1])


def test_pick_tile():
    assert pick_tile(4096, 128, 4) == 128
    assert pick_tile(4096, 64, 4) == 64
    assert pick_tile(14336, 14336, 8) == 128      # one group per row
    assert pick_tile(96, 32, 4) == 32
    assert pick_tile(100, 100, 4) is None          # no tile divides the row
    assert pick_tile(4096, 128, 3) is None         # only 4 and 8 bits


@pytest.mark.parametrize("m,n,k,bits,group,sym,split", [
    (1, 48, 256, 4, 64, False, 1),     # N not a multiple of the block
    (1, 40, 256, 4, 128, True, 2),     # split K, symmetric
    (3, 72, 256, 4, 64, False, 4),     # three rows (block of 4), split K
    (2, 40, 128, 8, 128, True, 2),     # int8, one group per row
    (4, 33, 192, 8, 64, False, 3),
])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_matches_reference(m, n, k, bits, group, sym, split, dtype):
    codes, packed, s, z = _quantized(n, k, bits, group, sym)
    tile = pick_tile(k, group, bits)
    words = tile_codes(codes, bits, tile)
    x = torch.randn(m, k).to(dtype)
    dev = lambda t: None if t is None else t.to(DEVICE)     # noqa: E731
    cfg = dict(BLOCK_N=16, SPLIT_K=split, num_warps=2, num_stages=2, PREFETCH=split % 2 == 0)
    for _ in range(2):     # the second call finds the arrival counters back at zero
        y = int_weight_gemv(dev(x), dev(words), dev(s), dev(z), bits, group, tile, cfg)
        ref = reference.int_weight_linear(x.float(), packed, s, z, bits, group)
        assert y.dtype == dtype and y.shape == (m, n)
        torch.testing.assert_close(y.float().cpu(), ref, atol=TOL[dtype], rtol=TOL[dtype])


def test_gemv_default_config_and_bad_rows():
    codes, packed, s, z = _quantized(64, 256, 4, 128, False)
    words = tile_codes(codes, 4, 128)
    x = torch.randn(1, 256, dtype=torch.float32)
    y = int_weight_gemv(x.to(DEVICE), words.to(DEVICE), s.to(DEVICE), z.to(DEVICE), 4, 128, 128)
    ref = reference.int_weight_linear(x, packed, s, z, 4, 128)
    torch.testing.assert_close(y.float().cpu(), ref, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="rows"):
        int_weight_gemv(torch.randn(5, 256).to(DEVICE), words.to(DEVICE), s.to(DEVICE),
                        z.to(DEVICE), 4, 128, 128)


@pytest.mark.parametrize("bits,group,sym", [(4, 64, False), (8, 128, True)])
def test_dequantize_tiled(bits, group, sym):
    codes, packed, s, z = _quantized(40, 256, bits, group, sym)
    tile = pick_tile(256, group, bits)
    w = dequantize_tiled(tile_codes(codes, bits, tile).to(DEVICE), s.to(DEVICE),
                         None if z is None else z.to(DEVICE), bits, group, tile, torch.float32)
    eye = torch.eye(256)
    ref = reference.int_weight_linear(eye, packed, s, z, bits, group).t()    # [n, k]
    torch.testing.assert_close(w.cpu(), ref, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("m", [2, 9, 300])
def test_tiled_gemm_every_batch_path(m):
    """tiled_int_weight_gemm by batch size: GEMV (<= 4 rows), the tensor-core kernel on the
    tiled words, the dequantize-then-matmul path (>= DEQUANT_ROWS)."""
    from slipstream.kernels.quant_gemm import tiled_int_weight_gemm
    codes, packed, s, z = _quantized(32, 128, 4, 64, False)
    words = tile_codes(codes, 4, 64)
    x = torch.randn(m, 128, dtype=torch.float32)
    y = tiled_int_weight_gemm(x.to(DEVICE), words.to(DEVICE), s.to(DEVICE), z.to(DEVICE), 4, 64, 64)
    ref = reference.int_weight_linear(x, packed, s, z, 4, 64)
    # On a GPU the tensor-core paths take fp32 operands as TF32 (10-bit mantissa).
    tol = 2e-2 if DEVICE == "cuda" and m > 4 else 1e-4
    torch.testing.assert_close(y.float().cpu(), ref, atol=tol, rtol=tol)

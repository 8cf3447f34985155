"""The tensor-core 4-bit GEMV (kernels/w4_mma_gemv.py): packing, the kernel's data flow
step by step in PyTorch (unpack, join tree, reshapes, mma), and, on a GPU, the kernel."""
import pytest
import torch

from slipstream.kernels import w4_mma_gemv as W
from slipstream.kernels import w4_wgmma_gemm as WG


def _weight(n, k, seed=0, zeros=True):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    scales = torch.rand(n, k // 128, generator=g) * 0.02 + 0.001
    z = torch.randint(0, 16, (n, k // 128), dtype=torch.uint8, generator=g) if zeros else None
    return codes, scales, z


def _reference(x, codes, scales, z):
    zz = torch.full_like(scales, 8.0) if z is None else z.float()
    w = (codes.float() - zz.repeat_interleave(128, 1)) * scales.repeat_interleave(128, 1)
    return x.float() @ w.t()


@pytest.mark.parametrize("n,k", [(64, 128), (200, 384), (300, 256)])
def test_pack_round_trip(n, k):
    codes, scales, z = _weight(n, k)
    p = W.pack_w4_mma(codes, scales, z)
    assert p.words.shape == (-(-n // 64), k // 128, 128, 8)
    assert torch.equal(W.unpack_w4_mma(p), codes)


def test_pack_rejects_bad_group():
    codes, scales, z = _weight(64, 256)
    with pytest.raises(ValueError):
        W.pack_w4_mma(codes[:, :200], scales, z)


@pytest.mark.parametrize("zeros", [True, False])
@pytest.mark.parametrize("offset", [128.0, 1024.0])
def test_emulation_matches_reference(zeros, offset):
    codes, scales, z = _weight(192, 512, zeros=zeros)
    p = W.pack_w4_mma(codes, scales, z)
    x = torch.randn(5, 512)
    ref = _reference(x, codes, scales, z)
    torch.testing.assert_close(W.emulate_w4_mma(x, p, offset), ref, rtol=1e-4, atol=1e-3)


def _unpack_words(words, offset):
    """The asm of `_unpack` on int32 words [128, 8] (pack=2): output 4 c + s of the pair
    (2 i, 2 i + 1) holds nibbles s (low half, element 2 i) and s + 4 (high half, element
    2 i + 1) of word 2 i + c, as OFFSET + code."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    outs = []
    for o in range(8):
        c, s = divmod(o, 4)
        src = w[:, c::2]                                         # [128, 4] word 2 i + c
        lo = (src >> (4 * s)) & 0xF
        hi = (src >> (4 * s + 16)) & 0xF
        outs.append(torch.stack([lo, hi], -1).reshape(128, 8).float() + offset)
    return outs


def test_kernel_data_flow_in_torch():
    """The kernel's steps on one (block, group, row tile) with torch's reshape/permute
    (the semantics of Gluon's): A from the words, B from x, one mma = the reference."""
    codes, scales, z = _weight(64, 128)
    p = W.pack_w4_mma(codes, scales, z)
    o = _unpack_words(p.words[0, 0], 0.0)
    j = lambda a, b: torch.stack([a, b], -1)                     # gl.join
    a = j(j(j(o[0], o[4]), j(o[1], o[5])), j(j(o[2], o[6]), j(o[3], o[7])))
    a = a.reshape([2] * 13).permute(W.W_PERM).reshape(64, 128)   # A [rows, mma inputs]
    x = torch.randn(8, 128)
    b = x.reshape([2] * 10).permute(W.X_PERM).reshape(128, 8)    # B [mma inputs, rows of x]
    torch.testing.assert_close(a @ b, (x @ codes.float().t()).t(), rtol=1e-5, atol=1e-4)


def test_scaled_unpack_in_torch():
    """The warpgroup kernel's unpack (UNPACK_SCALED): each output register's rows are
    16 w + g for even s, 8 below for odd s (nibble h = s & 1), so (output - OFFSET - zero)
    x scale of those rows, then the same join tree and reshapes, gives A = (code - zero)
    x scale with its columns in the mma's input order."""
    codes, scales, z = _weight(64, 128)
    p = W.pack_w4_mma(codes, scales, z)
    o = _unpack_words(p.words[0, 0], 128.0)
    pt = torch.arange(128)
    lo = 16 * (pt // 32) + (pt // 4) % 8
    zf, sf = z[:, 0].float() + 128.0, scales[:, 0].float()
    o = [(oi - zf[lo + 8 * (i % 2)][:, None]) * sf[lo + 8 * (i % 2)][:, None]
         for i, oi in enumerate(o)]
    j = lambda a, b: torch.stack([a, b], -1)                     # gl.join
    a = j(j(j(o[0], o[4]), j(o[1], o[5])), j(j(o[2], o[6]), j(o[3], o[7])))
    a = a.reshape([2] * 13).permute(W.W_PERM).reshape(64, 128)   # [rows, mma inputs]
    x = torch.randn(8, 128)
    b = x.reshape([2] * 10).permute(W.X_PERM).reshape(128, 8)
    want = x @ ((codes.float() - z.float()) * scales[:, :1].float()).t()
    torch.testing.assert_close(a @ b, want.t(), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dequantize(dtype):
    """The Triton dequantizer (the interpreter on a CPU) against the plain weight."""
    codes, scales, z = _weight(100, 256)
    p = W.pack_w4_mma(codes, scales, z)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    p = W.W4Mma(p.words.to(dev), p.scales.to(dev), p.zeros.to(dev), p.n, p.k)
    w = W.dequantize_w4_mma(p, dtype)
    want = (codes.float() - z.float().repeat_interleave(128, 1)) * scales.repeat_interleave(128, 1)
    torch.testing.assert_close(w.float().cpu(), want, rtol=1e-3, atol=1e-4)


def test_column_blocks():
    assert [W.column_blocks(m) for m in (1, 8, 9, 16, 17, 33, 64)] == [1, 1, 2, 2, 4, 8, 8]


@pytest.mark.skipif(not torch.cuda.is_available() or not W.HAVE_GLUON, reason="needs a GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k,cfg", [(1, 4096, 4096, None), (3, 200, 512, dict(NT=1, SPLIT=2)),
                                       (8, 1000, 1024, dict(NT=4, SPLIT=1)),
                                       (5, 320, 2048, dict(NT=4, SPLIT=4)),
                                       (16, 300, 1024, dict(NT=2, SPLIT=3)),
                                       (27, 640, 1024, dict(NT=2, SPLIT=2)),
                                       (64, 256, 512, None)])
def test_kernel_matches_reference(dtype, m, n, k, cfg):
    _check_kernel(W.w4_mma_gemv, dtype, m, n, k, cfg)


def _check_kernel(product, dtype, m, n, k, cfg):
    codes, scales, z = _weight(n, k, seed=n + k)
    p = W.pack_w4_mma(codes.cuda(), scales.cuda(), z.cuda())
    x = torch.randn(m, k).to(dtype)
    y = product(x.cuda(), p, cfg)
    ref = _reference(x.float(), codes, scales, z)
    torch.testing.assert_close(y.float().cpu(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
    assert torch.equal(y, product(x.cuda(), p, cfg))   # the counters were left at zero


@pytest.mark.skipif(not torch.cuda.is_available() or not W.HAVE_GLUON, reason="needs a GPU")
@pytest.mark.parametrize("sym", [False, True])
def test_layer_takes_the_mma_path(sym):
    """A 4-bit layer in groups of 128 re-lays its codes out on the first CUDA product and
    gives the plain product at every batch size (GEMV up to 64 rows, cuBLAS above)."""
    from torch import nn

    from slipstream.kernels import reference
    from slipstream.quant.int_weight import IntWeightMethod, set_quantized
    codes, scales, z = _weight(320, 512, zeros=not sym)
    layer = nn.Module()
    layer.group_cols, layer.bias = 128, None
    set_quantized(layer, codes, scales, z, 4, sym, "cuda")
    want_q = (layer.qweight.clone(), layer.scales.clone(), None if sym else layer.qzeros.clone())
    method = IntWeightMethod(4, 128, sym=sym, prequantized=True)
    for m in (1, 9, 64, 65, 200):
        x = torch.randn(m, 512, device="cuda").to(torch.bfloat16)
        y = method.apply(layer, x)
        assert getattr(layer, "w4_mma", None) is not None and not hasattr(layer, "qweight")
        want = reference.int_weight_linear(x.float(), *want_q, 4, 128)
        torch.testing.assert_close(y.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


_HOPPER = (torch.cuda.is_available() and W.HAVE_GLUON
           and torch.cuda.get_device_capability()[0] == 9)


@pytest.mark.skipif(not _HOPPER, reason="needs an sm_90 GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k,cfg", [(9, 4096, 4096, None),
                                       (16, 200, 512, dict(NT=1, WGS=1, SPLIT=2)),
                                       (33, 1000, 1024, dict(NT=2, WGS=1, SPLIT=1)),
                                       (64, 320, 2048, dict(NT=2, WGS=2, SPLIT=4)),
                                       (100, 640, 1024, dict(NT=1, WGS=2, SPLIT=3)),
                                       (40, 130, 1024, dict(NT=1, WGS=2, SPLIT=1)),
                                       (24, 512, 1024, dict(NT=2, WGS=1, SPLIT=1)),
                                       (128, 640, 2048, dict(NT=1, WGS=2, SPLIT=2, ASMEM=True)),
                                       (50, 1000, 1024, dict(NT=1, WGS=1, SPLIT=1, ASMEM=True)),
                                       (16, 320, 1024, dict(NT=1, WGS=1, SPLIT=3, ASMEM=True)),
                                       (128, 256, 512, None)])
def test_wgmma_kernel_matches_reference(dtype, m, n, k, cfg):
    _check_kernel(WG.w4_wgmma_gemm, dtype, m, n, k, cfg)


@pytest.mark.skipif(not _HOPPER, reason="needs an sm_90 GPU")
def test_product_tunes_over_every_path():
    """w4_mma_product at 16-128 rows: whichever path the tuner keeps, the plain product."""
    from slipstream.kernels.quant_gemm import w4_mma_product
    codes, scales, z = _weight(1024, 1024, seed=3)
    p = W.pack_w4_mma(codes.cuda(), scales.cuda(), z.cuda())
    for m in (16, 64, 96, 128, 129):
        x = torch.randn(m, 1024).to(torch.bfloat16)
        ref = _reference(x.float(), codes, scales, z)
        y = w4_mma_product(x.cuda(), p)
        torch.testing.assert_close(y.float().cpu(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())

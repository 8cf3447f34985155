"""The tensor-core 4-bit GEMV (kernels/w4_mma_gemv.py): packing, the kernel's data flow
step by step in PyTorch (unpack, join tree, reshapes, mma), and, on a GPU, the kernel."""
import pytest
import torch

from slipstream.kernels import w4_mma_gemv as W


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


@pytest.mark.parametrize("n,k,nt", [(64, 128, 1), (200, 384, 2), (300, 256, 4)])
def test_pack_round_trip(n, k, nt):
    codes, scales, z = _weight(n, k)
    p = W.pack_w4_mma(codes, scales, z, nt)
    assert p.words.shape == (-(-n // (64 * nt)), k // 128, nt, 128, 8)
    assert torch.equal(W.unpack_w4_mma(p), codes)


def test_pack_rejects_bad_group():
    codes, scales, z = _weight(64, 256)
    with pytest.raises(ValueError):
        W.pack_w4_mma(codes[:, :200], scales, z)


@pytest.mark.parametrize("zeros", [True, False])
@pytest.mark.parametrize("offset", [128.0, 1024.0])
def test_emulation_matches_reference(zeros, offset):
    codes, scales, z = _weight(192, 512, zeros=zeros)
    p = W.pack_w4_mma(codes, scales, z, 2)
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
    p = W.pack_w4_mma(codes, scales, z, 1)
    o = _unpack_words(p.words[0, 0, 0], 0.0)
    j = lambda a, b: torch.stack([a, b], -1)                     # gl.join
    a = j(j(j(o[0], o[4]), j(o[1], o[5])), j(j(o[2], o[6]), j(o[3], o[7])))
    a = a.reshape([2] * 13).permute(W.W_PERM).reshape(64, 128)   # A [rows, mma inputs]
    x = torch.randn(8, 128)
    b = x.reshape([2] * 10).permute(W.X_PERM).reshape(128, 8)    # B [mma inputs, rows of x]
    torch.testing.assert_close(a @ b, (x @ codes.float().t()).t(), rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available() or not W.HAVE_GLUON, reason="needs a GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k,nt,split", [(1, 4096, 4096, 2, None), (3, 200, 512, 1, 2),
                                             (8, 1000, 1024, 4, 1), (5, 320, 2048, 4, 4)])
def test_kernel_matches_reference(dtype, m, n, k, nt, split):
    codes, scales, z = _weight(n, k, seed=n + k)
    p = W.pack_w4_mma(codes, scales, z, nt)
    p = W.W4Mma(p.words.cuda(), p.scales.cuda(), p.zeros.cuda(), p.n, p.k, p.nt)
    x = torch.randn(m, k).to(dtype)
    y = W.w4_mma_gemv(x.cuda(), p, split)
    ref = _reference(x.float(), codes, scales, z)
    torch.testing.assert_close(y.float().cpu(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())

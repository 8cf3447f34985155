"""The few-row tensor-core GEMM against F.linear (Triton's interpreter on a CPU)."""
import pytest
import torch
import torch.nn.functional as F

from slipstream.kernels.skinny_gemm import MAX_ROWS, fits, skinny_gemm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("m,n,k", [(61, 40, 96), (2, 24, 64), (17, 33, 80), (64, 16, 32)])
def test_skinny_gemm_matches_linear(m, n, k):
    gen = torch.Generator().manual_seed(m * 1000 + n)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(DEVICE)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(torch.bfloat16).to(DEVICE)
    got = skinny_gemm(x, w)
    want = F.linear(x.float(), w.float())
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=1e-2)


def test_skinny_gemm_writes_a_strided_output_and_refuses_what_it_cannot_do():
    x = torch.randn(5, 32).to(torch.bfloat16).to(DEVICE)
    w = torch.randn(24, 32).to(torch.bfloat16).to(DEVICE)
    wide = torch.zeros(5, 40, dtype=torch.bfloat16, device=DEVICE)
    skinny_gemm(x, w, out=wide[:, 8:32])
    torch.testing.assert_close(wide[:, 8:32].float(), F.linear(x.float(), w.float()),
                               atol=5e-2, rtol=1e-2)
    assert torch.count_nonzero(wide[:, :8]) == 0 and torch.count_nonzero(wide[:, 32:]) == 0
    assert not fits(torch.randn(MAX_ROWS + 1, 32).bfloat16(), w.cpu())
    assert not fits(x.float().cpu(), w.float().cpu())            # fp32: cuBLAS keeps it
    with pytest.raises(ValueError, match="16-bit"):
        skinny_gemm(x[:1], w)

"""Decode GEMV (kernels/dense_gemv.py) against torch's linear (fp32 on upcast inputs)."""
import pytest
import torch
import torch.nn.functional as F

from slipstream.kernels.dense_gemv import MAX_ROWS, dense_gemv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 2e-3), (torch.float32, 1e-5)])
@pytest.mark.parametrize("m,n,k", [(1, 50, 70), (3, 33, 100), (4, 64, 64), (2, 7, 300)])
def test_dense_gemv_matches_linear(dtype, tol, m, n, k):
    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype).to(DEVICE)
    out = dense_gemv(x, w)
    assert out.shape == (m, n) and out.dtype == dtype
    torch.testing.assert_close(out.float(), F.linear(x.float(), w.float()), atol=tol, rtol=tol)


def test_dense_gemv_strided_rows_and_config():
    """x a row-strided view; a config whose tiles overhang N and K."""
    x = torch.randn(3, 96)[:, :80].to(DEVICE)
    w = torch.randn(40, 80).to(DEVICE)
    out = dense_gemv(x, w, config={"BLOCK_N": 32, "BLOCK_K": 64})
    torch.testing.assert_close(out, F.linear(x, w), atol=1e-4, rtol=1e-4)


def test_dense_gemv_rejects_bad_shapes():
    with pytest.raises(ValueError, match="at most"):
        dense_gemv(torch.randn(MAX_ROWS + 1, 8), torch.randn(4, 8))
    with pytest.raises(ValueError, match="columns"):
        dense_gemv(torch.randn(1, 8), torch.randn(4, 9))


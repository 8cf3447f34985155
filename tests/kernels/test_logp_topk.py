"""The log-probability top-k kernel against its twin (log_softmax, a stable
descending sort cut to k): values to fp32 rounding, indices exactly, ties to the
first column, alone and as the op torch.compile'd callers use."""
import pytest
import torch

from slipstream.kernels.logp_topk import logp_topk, logp_topk_op, logp_topk_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("rows,n,k,dtype", [(1, 4096, 8, torch.bfloat16), (5, 3000, 8, torch.bfloat16),
                                            (3, 1000, 5, torch.float32), (2, 7, 7, torch.float32),
                                            (4, 2500, 64, torch.float16), (2, 1024, 1, torch.float32)])
def test_logp_topk_matches_log_softmax_and_a_stable_sort(rows, n, k, dtype):
    gen = torch.Generator().manual_seed(rows * n + k)
    x = (torch.randn(rows, n, generator=gen) * 4).to(dtype).to(DEVICE)   # bf16: many ties
    values, indices = logp_topk(x, k)
    want_v, want_i = logp_topk_reference(x, k)
    assert values.dtype == torch.float32 and indices.dtype == torch.int64
    assert torch.equal(indices, want_i)
    torch.testing.assert_close(values, want_v, rtol=0, atol=2e-6)


def test_ties_go_to_the_first_column_across_pieces():
    x = torch.zeros(2, 3000, device=DEVICE)
    x[:, [2900, 5, 1500, 900]] = 1.0                    # equal maxima in three pieces
    x[1, 2999] = 2.0
    _, indices = logp_topk(x, 5)
    assert indices.tolist() == [[5, 900, 1500, 2900, 0], [2999, 5, 900, 1500, 2900]]


def test_a_strided_row_and_bad_k():
    x = torch.randn(3, 600, device=DEVICE)[:, ::2]
    values, indices = logp_topk(x, 4)
    want_v, want_i = logp_topk_reference(x, 4)
    assert torch.equal(indices, want_i)
    torch.testing.assert_close(values, want_v, rtol=0, atol=2e-6)
    with pytest.raises(ValueError, match="k must be"):
        logp_topk(x, 0)
    with pytest.raises(ValueError, match="k must be"):
        logp_topk(torch.randn(1, 5, device=DEVICE), 6)


def test_the_op_under_torch_compile():
    x = torch.randn(4, 2048, device=DEVICE)
    fn = torch.compile(lambda t: logp_topk_op(t * 2.0, 8), dynamic=False)
    values, indices = fn(x)
    want_v, want_i = logp_topk_reference(x * 2.0, 8)
    assert torch.equal(indices, want_i)
    torch.testing.assert_close(values, want_v, rtol=0, atol=2e-6)


def test_k1_is_argmax_with_ties_to_the_first():
    """k = 1 over bf16 rows of a 49,152-token vocabulary, ties included, is torch's
    argmax (first occurrence)."""
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(5, 49152, generator=gen) * 3).bfloat16()
    x[2, [100, 30000]] = 50.0                             # a tie across pieces
    x = x.to(DEVICE)
    _, indices = logp_topk(x, 1)
    assert indices[:, 0].tolist() == x.float().argmax(-1).tolist()
    assert indices[2, 0].item() == 100

"""The KV slot move kernel against its twin (two index ops): exact, for moves whose
sources are other moves' destinations, for 16-bit, fp32 and 8-bit pools."""
import pytest
import torch

from slipstream.kernels.kv_move import move_rows, move_rows_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype,tail", [(torch.bfloat16, (3, 64)), (torch.float32, (2, 8)),
                                        (torch.int8, (3, 5)), (torch.float16, (1,))])
def test_move_rows_matches_the_index_ops(dtype, tail):
    gen = torch.Generator().manual_seed(0)
    shape = (3, 2, 5, 4) + tail                         # layers, K/V, blocks, block size, ...
    pool = (torch.randn(shape, generator=gen) * 50).to(dtype).to(DEVICE)
    # A path: slot 9 <- 11, 10 <- 13, 11 <- 12 (11 is read before it is written), 12 stays.
    src = torch.tensor([11, 13, 12, 12], device=DEVICE)
    dst = torch.tensor([9, 10, 11, 12], device=DEVICE)
    want = pool.clone()
    move_rows_reference(want, src, dst)
    got = pool.clone()
    move_rows(got, src, dst, kernel=True)
    assert torch.equal(got, want)
    assert torch.equal(got.flatten(2, 3)[:, :, 11], pool.flatten(2, 3)[:, :, 12])
    assert torch.equal(got.flatten(2, 3)[:, :, 9], pool.flatten(2, 3)[:, :, 11])


def test_move_rows_reference_takes_float8_pools():
    pool = torch.randn(2, 2, 3, 4, 2, 8).to(torch.float8_e4m3fn)
    want = pool.view(torch.uint8).clone()
    move_rows(pool, torch.tensor([5, 6]), torch.tensor([1, 2]))
    want.flatten(2, 3)[:, :, [1, 2]] = want.flatten(2, 3)[:, :, [5, 6]]
    assert torch.equal(pool.view(torch.uint8), want)


def test_a_failing_launch_falls_back_to_the_twin(monkeypatch):
    import slipstream.kernels.kv_move as kv_move

    class Broken:
        def __getitem__(self, grid):
            raise RuntimeError("no build")
    monkeypatch.setattr(kv_move, "_move_rows_kernel", Broken())
    monkeypatch.setattr(kv_move, "enabled", True)
    pool = torch.randn(2, 2, 3, 4, 8, device=DEVICE)
    src, dst = torch.tensor([7, 3], device=DEVICE), torch.tensor([1, 2], device=DEVICE)
    want = pool.clone()
    move_rows_reference(want, src, dst)
    with pytest.warns(UserWarning, match="index ops"):
        move_rows(pool, src, dst, kernel=True)
    assert torch.equal(pool, want) and not kv_move.enabled

"""comm.all_reduce hands a group's small tensors to its registered small
all-reduce (the symmetric-memory one on GPUs) and everything else to
torch.distributed; the symmetric-memory one is built only where asked for."""
import torch

from slipstream.distributed import comm, symm_all_reduce


class Doubling:
    """Stands in for a 2-rank sum where both ranks hold the same tensor."""
    def __init__(self, max_numel):
        self.max_numel, self.calls = max_numel, 0

    def fits(self, x):
        return x.numel() <= self.max_numel

    def __call__(self, x):
        self.calls += 1
        return x.mul_(2)


def test_small_tensors_take_the_registered_all_reduce(monkeypatch):
    group = object()
    small = Doubling(8)
    seen = []
    monkeypatch.setattr(comm.dist, "all_reduce", lambda x, op=None, group=None: seen.append(x.numel()))
    comm.use_small_all_reduce(group, small)
    try:
        x = torch.ones(8)
        assert comm.all_reduce(x, group) is x and torch.equal(x, torch.full((8,), 2.0))
        comm.all_reduce(torch.ones(9), group)          # too large: torch.distributed
        comm.all_reduce(torch.ones(2), object())       # another group: torch.distributed
    finally:
        comm.use_small_all_reduce(group, None)
    assert small.calls == 1 and seen == [9, 2]
    comm.all_reduce(torch.ones(3), group)              # unregistered again
    assert seen == [9, 2, 3]


def test_symmetric_memory_all_reduce_is_opt_in(monkeypatch):
    monkeypatch.delenv("SLIPSTREAM_SYMM_ALL_REDUCE", raising=False)
    assert symm_all_reduce.build(object(), torch.device("cuda", 0), torch.bfloat16) is None
    monkeypatch.setenv("SLIPSTREAM_SYMM_ALL_REDUCE", "1")
    assert symm_all_reduce.build(object(), torch.device("cpu"), torch.float32) is None

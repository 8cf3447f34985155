"""The Gluon prefill kernels' work order (gluon_schedule.py), through its
plain-Python twin: every (query block, head, request) exactly once for every
order, and the balance the persistent orders were chosen for."""
import itertools

import pytest
import torch

from slipstream.kernels.gluon_prefill import kernel_args
from slipstream.kernels.gluon_schedule import ALL_HEADS, item_table, plan, schedule


def _busiest(order, per_item=1.5):
    """Largest program's causal work (tiles + a per-item overhead) over the mean."""
    work = [sum(b + 1 + per_item for b, _, _ in items) for items in order]
    return max(work) / (sum(work) / len(work))


@pytest.mark.parametrize("n_mblocks, heads, seqs", [(32, 16, 4), (5, 9, 3), (1, 1, 1), (7, 3, 2)])
@pytest.mark.parametrize("programs, snake, group", [
    (None, False, 0), (None, False, ALL_HEADS), (None, False, 4), (132, False, 0), (132, True, 0),
    (7, True, 2), (7, False, 5), (13, True, ALL_HEADS), (1, True, 3)])
def test_every_item_once(n_mblocks, heads, seqs, programs, snake, group):
    order = schedule(n_mblocks, heads, seqs, programs, snake, group)
    items = [x for prog in order for x in prog]
    assert sorted(items) == sorted(itertools.product(range(n_mblocks), range(heads), range(seqs)))


def test_lpt_orders_longest_first_and_balance():
    grid = schedule(32, 16, 4, None, False, ALL_HEADS)
    assert [b for (b, _, _), in grid] == sorted((b for (b, _, _), in grid), reverse=True)
    for shape in [(32, 16, 4), (128, 16, 1), (64, 16, 2)]:  # 4 x 4k, 1 x 16k, 2 x 8k at BLOCK_M 128
        plain, lpt = schedule(*shape, 132), schedule(*shape, 132, True, ALL_HEADS)
        assert _busiest(lpt) < 1.04 < _busiest(plain), shape


def test_order_options_checked():
    q = torch.zeros(64, 4, 128, dtype=torch.bfloat16)
    cu = torch.tensor([0, 64], dtype=torch.int32)
    pp = {"WS": True, "PINGPONG": True, "num_warps": 4}
    with pytest.raises(ValueError, match="SNAKE"):
        kernel_args(q, q, q, q, cu, 64, 0.1, True, {**pp, "SNAKE": True})
    with pytest.raises(ValueError, match="HEAD_GROUP"):
        kernel_args(q, q, q, q, cu, 64, 0.1, True, {**pp, "HEAD_GROUP": -1})
    _, consts, grid = kernel_args(q, q, q, q, cu, 64, 0.1, True,
                                  {**pp, "PERSISTENT": True, "SNAKE": True, "HEAD_GROUP": ALL_HEADS})
    assert consts["SNAKE"] and consts["HEAD_GROUP"] == ALL_HEADS and grid == (4, 1, 1)


def test_item_table_lists_nonempty_items_longest_first():
    lengths, heads = [300, 1, 129], 2
    table = item_table(lengths, heads, 128, 64, True, "cpu").tolist()
    n, items = table[0], [tuple(table[1 + 3 * i: 4 + 3 * i]) for i in range(table[0])]
    expected = {(s, h, b) for s, L in enumerate(lengths) for h in range(heads) for b in range(-(-L // 128))}
    assert n == len(items) == len(expected) and set(items) == expected
    tiles = [-(-min(lengths[s], (b + 1) * 128) // 64) for s, _, b in items]  # causal key tiles
    assert tiles == sorted(tiles, reverse=True) and tiles[0] == 5 and tiles[-1] == 1
    full = item_table(lengths, heads, 128, 64, False, "cpu").tolist()
    assert [-(-lengths[full[1 + 3 * i]] // 64) for i in range(n)][:2] == [5, 5]


def test_plan_grids():
    cu = torch.tensor([0, 300, 301, 430], dtype=torch.int32)
    base = {"BLOCK_M": 128, "BLOCK_N": 128, "PERSISTENT": False, "TABLE": False}
    assert plan(base, None, 300, 4, cu, True, 132) == (cu, (3, 4, 3))
    assert plan({**base, "PERSISTENT": True}, None, 300, 4, cu, True, 132)[1] == (36, 1, 1)
    items, grid = plan({**base, "TABLE": True}, [300, 1, 129], 300, 4, cu, True, 132)
    assert grid == (4 * (3 + 1 + 2), 1, 1) and items[0] == 24
    assert plan({**base, "TABLE": True, "PERSISTENT": True}, [300, 1, 129], 300, 4, cu, True, 8)[1] == (8, 1, 1)
    with pytest.raises(ValueError, match="TABLE"):
        plan({**base, "TABLE": True}, None, 300, 4, cu, True, 132)
    with pytest.raises(ValueError, match="TABLE"):
        plan({**base, "TABLE": True}, [300, 1], 300, 4, cu, True, 132)

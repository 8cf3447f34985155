"""Tree kernel against `reference.tree_attention` (fp32 on upcast inputs).

Tolerance (max abs and rel error): fp16 4e-3. Outputs start as NaN; caches are
NaN outside the written slots.
"""
import pytest
import torch

from slipstream.kernels import reference
from slipstream.kernels.tree_attention import ancestor_mask, tree_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
#        0
#      /   \
#     1     2        two branches, depth 3
#    / \    |
#   3   4   5
#   |
#   6
PARENTS = [-1, 0, 0, 1, 1, 2, 3]


@pytest.mark.parametrize("group,splits,window", [(1, 1, None), (4, 4, None), (8, 2, 20)])
def test_tree_with_branches(paged_batch, close, group, splits, window):
    contexts, nodes = [0, 30, 70], [7, 1, 4]  # empty context; a one-node tree; a pruned tree
    b = paged_batch(contexts, nodes, 8, 8 // group, 64, 16, device=DEVICE)
    full = ancestor_mask(PARENTS)
    masks = torch.zeros(len(nodes), 7, 7, dtype=torch.bool)
    for i, n in enumerate(nodes):
        masks[i, :n, :n] = full[:n, :n]
    masks = masks.to(DEVICE)
    out = torch.full(b.q.shape, float("nan"), dtype=b.q.dtype, device=DEVICE)
    tree_attention(b.q, b.k_cache, b.v_cache, b.cu_seqlens_q, b.seq_lens, b.block_tables, masks,
                   0.125, max_query_len=b.max_query_len, max_seq_len=int(b.seq_lens.max()),
                   sliding_window=window, num_splits=splits, out=out)
    ref = reference.tree_attention(b.q.float(), b.k_cache.float(), b.v_cache.float(),
                                   b.cu_seqlens_q, b.seq_lens, b.block_tables, masks, 0.125, window)
    close(out, ref, 4e-3, 4e-3)


def test_ancestor_mask():
    m = ancestor_mask(PARENTS)
    assert m[6].nonzero().flatten().tolist() == [0, 1, 3, 6]
    assert m[5].nonzero().flatten().tolist() == [0, 2, 5]
    assert torch.equal(m.diagonal(), torch.ones(7, dtype=torch.bool))


def test_tree_mask_shape_checked(paged_batch):
    b = paged_batch([5], [4], 2, 2, 64, 16, device=DEVICE)
    with pytest.raises(ValueError):
        tree_attention(b.q, b.k_cache, b.v_cache, b.cu_seqlens_q, b.seq_lens, b.block_tables,
                       torch.ones(1, 2, 2, dtype=torch.bool, device=DEVICE), 0.125,
                       max_query_len=4, max_seq_len=9)

"""Tree kernel against `reference.tree_attention` (fp32 on upcast inputs).

Tolerance (max abs and rel error): fp16 4e-3. Outputs start as NaN; caches are
NaN outside the written slots.
"""
import pytest
import torch

from slipstream.kernels import reference
from slipstream.kernels.tree_attention import pack_tree_mask
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


def test_pack_tree_mask_bits():
    mask = torch.rand(3, 5, 64, generator=torch.Generator().manual_seed(0)) < 0.5
    mask[0, 0, 63] = True
    bits = pack_tree_mask(mask)
    assert bits.dtype == torch.int64 and bits.shape == (3, 5)
    unpacked = (bits[..., None] >> torch.arange(64)) & 1
    assert torch.equal(unpacked.bool(), mask)
    with pytest.raises(ValueError, match="at most 64"):
        pack_tree_mask(torch.ones(1, 2, 65, dtype=torch.bool))


def test_tree_too_large_refused(paged_batch):
    b = paged_batch([3], [65], 2, 2, 16, 16, device=DEVICE)
    with pytest.raises(ValueError, match="at most 64 nodes"):
        tree_attention(b.q, b.k_cache, b.v_cache, b.cu_seqlens_q, b.seq_lens, b.block_tables,
                       torch.ones(1, 65, 65, dtype=torch.bool, device=DEVICE), 0.25,
                       max_query_len=65, max_seq_len=68)


def test_wide_tree_uses_high_mask_bits(paged_batch, close):
    """A 64-node tree: visibility bits up to 63 (past the int32 range) and a
    long ancestor chain."""
    gen = torch.Generator().manual_seed(1)
    parents = [-1] + [int(torch.randint(max(0, i - 3), i, (1,), generator=gen)) for i in range(1, 64)]
    b = paged_batch([20], [64], 4, 2, 32, 16, device=DEVICE)
    masks = ancestor_mask(parents)[None].to(DEVICE)
    assert masks[0, 63, :32].any() and masks[0, 63, 32:].sum() > 1
    out = torch.full(b.q.shape, float("nan"), dtype=b.q.dtype, device=DEVICE)
    tree_attention(b.q, b.k_cache, b.v_cache, b.cu_seqlens_q, b.seq_lens, b.block_tables, masks,
                   0.2, max_query_len=64, max_seq_len=84, num_splits=2, out=out)
    ref = reference.tree_attention(b.q.float(), b.k_cache.float(), b.v_cache.float(),
                                   b.cu_seqlens_q, b.seq_lens, b.block_tables, masks, 0.2, None)
    close(out, ref, 4e-3, 4e-3)


def test_launch_config_of_one_short_tree(monkeypatch):
    """One request's tree in 16-row blocks, unsplit, 16-bit cache: SHORT_TREE_CONFIG;
    quantized caches, split steps and TREE_CONFIG's A/B strings keep their own."""
    from slipstream.kernels import decode_configs as dc
    monkeypatch.setattr(dc, "interpreting", lambda: False)
    monkeypatch.setattr(dc, "num_sms", lambda index=0: 132)
    dev = torch.device("cuda", 0)
    assert dc._launch_config(16, 36, dev, tree=True) == dc.SHORT_TREE_CONFIG
    assert dc._launch_config(16, 36, dev, quant=True, tree=True) == dc.QUANT_DEEP_CONFIG
    assert dc._launch_config(16, 72, dev, tree=True, splits=2) == dc.DEEP_CONFIG
    assert dc._launch_config(64, 9, dev, tree=True) == dc.TALL_CONFIG
    assert dc._launch_config(16, 36, dev) == dc.DEEP_CONFIG
    monkeypatch.setattr(dc, "TREE_CONFIG", "32x2x4")
    assert dc._launch_config(16, 36, dev, tree=True) == {"BLOCK_N": 32, "num_warps": 2, "num_stages": 4}
    with pytest.raises(ValueError, match="BLOCK_NxWARPSxSTAGES"):
        dc.parse_launch("32x2")

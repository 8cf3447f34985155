"""DraftTree: shape checks, the ancestor mask, positions, and K/V moves."""
import pytest
import torch

from slipstream.kernels.tree_attention import ancestor_mask
from slipstream.layers.sampler import Sampler, SamplingBatch
from slipstream.sampling_params import SamplingParams
from slipstream.spec.tree import DraftTree, TreeBatch, tree_mask_batch
from slipstream.spec.verify import target_probs

PARENTS = (-1, -1, 0, 0, 1, 2)


def test_mask_matches_the_kernel_reference_with_the_root_prepended():
    t = DraftTree(torch.arange(6), PARENTS)
    rows = [-1] + [p + 1 for p in PARENTS]          # row 0 = root
    assert torch.equal(t.ancestor_mask(), ancestor_mask(rows))
    assert t.depths == (1, 1, 2, 2, 2, 3) and t.depth == 3 and t.max_children == 2
    assert t.positions(10) == [10, 11, 11, 12, 12, 12, 13]
    assert t.path_to(5) == [0, 2, 5]
    assert t.kv_moves([0, 2, 5]) == [(3, 2), (6, 3)]


def test_chain_is_a_one_branch_tree():
    c = DraftTree.chain([7, 8, 9])
    assert c.is_chain and c.parents == (-1, 0, 1) and c.depth == 3
    assert torch.equal(c.ancestor_mask(), torch.ones(4, 4, dtype=torch.bool).tril())
    assert c.kv_moves([0, 1]) == []
    assert not DraftTree(torch.arange(6), PARENTS).is_chain


def test_bad_trees_are_refused():
    with pytest.raises(ValueError, match="parents"):
        DraftTree(torch.arange(2), (0, -1))
    with pytest.raises(ValueError, match="tokens"):
        DraftTree(torch.arange(3), (-1, 0))
    with pytest.raises(ValueError, match="draft_probs"):
        DraftTree(torch.arange(2), (-1, 0), torch.ones(3, 5))


def test_batch_padding():
    trees = [DraftTree(torch.arange(6), PARENTS), DraftTree.chain([4]), DraftTree.empty()]
    mask = tree_mask_batch(trees, "cpu")
    assert mask.shape == (3, 7, 7)
    assert torch.equal(mask[1, :2, :2], torch.ones(2, 2, dtype=torch.bool).tril())
    assert torch.equal(mask[2], torch.eye(7, dtype=torch.bool))
    tb = TreeBatch.stack(trees, "cpu", vocab_size=10)
    assert tb.children[0, 0].tolist() == [1, 2] and tb.children[0, 1].tolist() == [3, 4]
    assert tb.children[1, 0].tolist() == [1, 0] and tb.draft_probs is None
    assert tb.tokens[0].tolist() == [0, 0, 1, 2, 3, 4, 5]


def test_target_probs_is_what_the_sampler_draws_from():
    logits = torch.randn(4, 50)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=5),
              SamplingParams(temperature=1.3, top_p=0.8), SamplingParams(temperature=1.0, min_p=0.1)]
    sb = SamplingBatch.build(params, [[1]] * 4, [[]] * 4, [None] * 4, 50, "cpu")
    p = target_probs(logits, sb)
    assert torch.allclose(p.sum(1), torch.ones(4))
    assert p[0].argmax() == logits[0].argmax() and p[0].max() == 1.0
    assert (p[1] > 0).sum() == 5
    # Empirically: the sampler's draws follow p (TV distance over 10k draws < 0.04).
    draws = torch.stack([Sampler.sample(logits, sb) for _ in range(10_000)])
    for row in range(1, 4):
        freq = torch.bincount(draws[:, row], minlength=50).float() / draws.shape[0]
        assert 0.5 * (freq - p[row]).abs().sum() < 0.04

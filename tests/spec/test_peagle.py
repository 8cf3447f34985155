"""Parallel drafting (spec/peagle.py): K draft tokens from one head pass, greedy
output identical to plain decoding, and the drafting pass computes what the
training passes train (the same rows, the same context)."""
import torch

from slipstream.spec.eagle import EagleHead, EagleShape
from slipstream.spec.peagle import ParallelEagleProposer, ParallelExpander
from slipstream.spec.train import ttt_features
from slipstream.spec.generator import SpecStats, SpeculativeGenerator
from tests.spec.test_generator import GREEDY, PROMPTS, plain  # noqa: F401 (a fixture)


def _head(c, seed=0, parallel=1):
    torch.manual_seed(seed)
    return EagleHead(EagleShape(c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
                                c.head_dim, 64, c.rope_theta, c.max_position_embeddings,
                                parallel=parallel)).eval()


def test_a_head_without_placeholders_is_refused(tiny_target):
    import pytest
    with pytest.raises(ValueError, match="parallel drafting"):
        ParallelExpander(_head(tiny_target.config, parallel=0), None, None, None, 4)


def test_parallel_drafts_are_lossless_and_take_one_head_pass(tiny_target, plain):
    head = _head(tiny_target.config)
    proposer = ParallelEagleProposer(head, tiny_target.model.embed_tokens,
                                     tiny_target.compute_logits, depth=4)
    calls = []
    forward = head.forward
    head.forward = lambda *a, **k: calls.append(a[0].shape[0]) or forward(*a, **k)
    stats = SpecStats()
    gen = SpeculativeGenerator(tiny_target, proposer, num_blocks=64, block_size=4)
    assert gen.generate(PROMPTS, GREEDY, stats) == plain
    assert stats.drafted == 4 * stats.rounds and stats.accepted > 0
    # A round: the catch-up pass, then one pass of K - 1 = 3 rows (never three passes).
    assert calls.count(3) >= stats.rounds - len(PROMPTS)
    assert not proposer.kv


def test_the_drafting_pass_is_the_training_passes():
    """Training pass s row j (its placeholders from s = 2) and drafting after the real
    pairs <= j - s give the same feature: the head is trained on what it meets."""
    torch.manual_seed(3)
    h = 32
    head = EagleHead(EagleShape(h, 4, 2, 8, 48, parallel=1)).eval()
    n, steps = 10, 4
    e, feat = torch.randn(1, n, h), torch.randn(1, n, h)
    with torch.no_grad():
        outs = ttt_features(head, e, feat, steps)
        j = 8                                 # drafting after the real pairs 0 .. j - 3
        real = j - (steps - 1)
        pos = torch.arange(real + 1)
        f0, k, v = head(e[0, :real + 1], feat[0, :real + 1], pos, None, None)
        # Row 0 of the parallel pass: (feature after the root, the first draft's token).
        rows_e = torch.cat([e[0, real + 1:real + 2], head.mask_emb.expand(steps - 2, -1)])
        rows_f = torch.cat([f0[-1:], head.mask_feat.expand(steps - 2, -1)])
        mask = torch.ones(steps - 1, real + 1 + steps - 1, dtype=torch.bool)
        mask[:, real + 1:] = torch.ones(steps - 1, steps - 1, dtype=torch.bool).tril()
        f, _, _ = head(rows_e, rows_f, real + 1 + torch.arange(steps - 1), (k, v), mask)
    for s in range(1, steps):
        assert torch.allclose(f[s - 1], outs[s][0, real + s], atol=1e-5), s


def test_the_chain_follows_the_draft_budget(tiny_target):
    from slipstream.spec.base import ProposeRequest
    head = _head(tiny_target.config)
    p = ParallelEagleProposer(head, tiny_target.model.embed_tokens, tiny_target.compute_logits,
                              depth=5)
    h = torch.randn(3, tiny_target.config.hidden_size)
    full, cut = p.propose([ProposeRequest("a", [1, 2, 3, 4], h),
                           ProposeRequest("b", [1, 2, 3, 4], h, num_tokens=2)])
    assert full.parents == (-1, 0, 1, 2, 3) and cut.parents == (-1, 0)
    assert torch.equal(cut.tokens, full.tokens[:2])


def test_every_shipped_head_loads_as_its_method_needs():
    from slipstream.spec.heads import SHIPPED, resolve_head
    from slipstream.spec.medusa import MedusaHeads
    for kind in SHIPPED:
        path = resolve_head(None, kind)
        if kind == "medusa":
            assert MedusaHeads.load(path) is not None
        else:
            head = EagleHead.load(path)
            assert head.shape.parallel == (kind == "peagle") and head.shape.hidden_size == 576

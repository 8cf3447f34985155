"""EAGLE's draft head in one C call (kernels/cpu_eagle.py) against its torch twins:
EagleHead.forward for the head's rows, EagleTreeExpander.levels for a chain."""
import pytest
import torch
from torch import nn

from slipstream.kernels import cpu_library
from slipstream.kernels.cpu_eagle import CPUEagle, chain_table
from slipstream.kernels.cpu_quant import QuantMatrix
from slipstream.spec import cpu_draft
from slipstream.spec.eagle import _append_mask
from slipstream.spec.eagle_head import EagleHead, EagleShape
from slipstream.spec.eagle_tree import EagleTreeExpander
from slipstream.spec.heads import DraftLMHead
from tests.spec.conftest import draft_lm_head_over

pytestmark = pytest.mark.skipif(cpu_library.load() is None, reason="the CPU kernels are not built")

H, VOCAB = 64, 96


class _Embedding(nn.Module):
    def __init__(self, table: QuantMatrix):
        super().__init__()
        self.gguf_weight = table

    def forward(self, ids):
        return self.gguf_weight.get_rows(ids)


def _setup(seed=0, vocab_rows=40, parallel=0):
    g = torch.Generator().manual_seed(seed)
    shape = EagleShape(hidden_size=H, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96,
                       parallel=parallel)
    head = EagleHead(shape)
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g) if "norm" in name
                    else 0.15 * torch.randn(p.shape, generator=g))
    head = head.requires_grad_(False).eval()
    table = QuantMatrix([(cpu_draft.Q8_0, cpu_draft.q8_0_blocks(torch.randn(VOCAB, H, generator=g)))], H)
    base = draft_lm_head_over(table, torch.randperm(VOCAB, generator=g)[:vocab_rows])
    lm_head = cpu_draft.quantize_head(head, base)     # the head's layers on Q8_0 blocks
    assert isinstance(lm_head, cpu_draft.QuantDraftLMHead)
    embed = _Embedding(table)
    cpu = CPUEagle.build(head, lm_head, embed)
    assert cpu is not None
    return head, lm_head, embed, cpu, g


def _past(g, ctx):
    k = torch.randn(ctx, 2, 16, generator=g)
    v = torch.randn(ctx, 2, 16, generator=g)
    valid = torch.rand(ctx, generator=g) > 0.3
    return k, v, valid


@pytest.mark.parametrize("ctx,t", [(0, 3), (7, 1), (12, 4)])
def test_head_rows_match_the_torch_head(ctx, t):
    head, _, embed, cpu, g = _setup()
    k, v, valid = _past(g, ctx)
    toks = torch.randint(0, VOCAB, (t,), generator=g)
    feat = torch.randn(t, H, generator=g)
    pos = torch.arange(ctx, ctx + t)
    emb = embed(toks)
    past, mask = ((k, v), _append_mask(valid, t)) if ctx else (None, None)
    want = head(emb, feat, pos, past, mask)
    got = cpu.rows(emb, feat, pos, *((k, v, valid) if ctx else (None,) * 3))
    for w, o in zip(want, got):
        torch.testing.assert_close(o, w.reshape(o.shape), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("topk,depth", [(1, 3), (3, 4)])
def test_chain_matches_the_expansion_with_one_beam(topk, depth):
    head, lm_head, embed, cpu, g = _setup(seed=1)
    k, v, valid = _past(g, 9)
    root = torch.randn(H, generator=g)
    ex = EagleTreeExpander(head, embed, lm_head, lm_head.token_ids, depth, topk, 1)
    want = ex.levels(root, k, v, valid, torch.tensor(9))
    ex.cpu_head = cpu
    got = ex.expand(root, k, v, 9, valid)
    assert got.shape == want.shape == (4, depth * topk)
    assert torch.equal(got[[0, 2, 3]], want[[0, 2, 3]])       # tokens, parents, levels
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-4)


def test_parallel_pass_matches_the_torch_pass():
    """P-EAGLE's one pass over the root's and the placeholders' rows (spec/peagle.py)."""
    from slipstream.spec.peagle import ParallelExpander
    head, lm_head, embed, cpu, g = _setup(seed=2, parallel=1)
    k, v, valid = _past(g, 6)
    root = torch.randn(H, generator=g)
    ex = ParallelExpander(head, embed, lm_head, lm_head.token_ids, 4)
    want = ex.expand(root, k, v, 6, valid)
    ex.cpu_head = cpu
    got = ex.expand(root, k, v, 6, valid)
    assert torch.equal(got[[0, 2, 3]], want[[0, 2, 3]])
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-4)


def test_chain_table_layout():
    tokens = torch.tensor([[5, 6], [7, 8], [9, 10]])
    logp = torch.tensor([[-0.1, -2.0], [-0.5, -1.0], [-0.2, -3.0]])
    t = chain_table(tokens, logp)
    assert t[0].tolist() == [5, 6, 7, 8, 9, 10]
    assert t[2].tolist() == [-1, -1, 0, 0, 2, 2]
    assert t[3].tolist() == [1, 1, 2, 2, 3, 3]
    torch.testing.assert_close(t[1], torch.tensor([-0.1, -2.0, -0.6, -1.1, -0.8, -3.6],
                                                  dtype=torch.float64))


def test_build_declines_a_dense_head():
    head = EagleHead(EagleShape(hidden_size=H, num_heads=4, num_kv_heads=2, head_dim=16,
                                intermediate_size=96))
    base = DraftLMHead.__new__(DraftLMHead)
    base.vocab, base.weight = None, None
    assert CPUEagle.build(head, base, nn.Embedding(VOCAB, H)) is None


def test_default_model_drafts_through_the_c_head_and_stays_exact():
    """The shipped head on the default model (GGUF blocks) drafts through one call
    (a chain with siblings: beam 1, top 2) and greedy outputs equal plain decoding's."""
    from slipstream import LLM, SamplingParams
    kw = dict(device="cpu", max_model_len=256, seed=0, kv_cache_memory=32 << 20)
    plain = LLM(**kw)
    spec = LLM(**kw, speculative_method="eagle", num_speculative_tokens=3,
               speculative_tree="2,1,6", speculative_auto_off=False)   # timing-free
    proposer = spec.engine.runner.speculator.proposer
    assert proposer.cpu_head is not None and proposer.expander.cpu_head is proposer.cpu_head
    if cpu_draft.BITS is None:       # the shipped head drafts from 4-bit copies
        assert proposer.head.q.qm.segments[0][0] == cpu_draft.Q4_1
        assert proposer.lm_head.rows.segments[0][0] == cpu_draft.Q4_1
    calls = []
    chain = proposer.cpu_head.chain
    proposer.cpu_head.chain = lambda *a: calls.append(1) or chain(*a)
    prompts = ["Write a haiku about the sea.", "Name three primary colors."]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert calls and spec.engine.spec_stats.tau > 1.2


def test_chain_stops_at_the_first_level_below_min_logp():
    """min_logp: the levels before the first whose best token's cumulative
    log-probability falls below it (none, some or all), the same tokens as the
    full chain's."""
    import math
    _, _, _, cpu, g = _setup(seed=3)
    k, v, valid = _past(g, 9)
    root = torch.randn(H, generator=g)
    tokens, logp = cpu.chain(root, k, v, valid, 9, 5, 2)
    cum = logp[:, 0].double().cumsum(0).tolist()
    cuts = [(cum[0] + 1.0, 0)] + [((cum[i] + cum[i + 1]) / 2, i + 1) for i in range(4)]
    for th, kept in cuts + [(-math.inf, 5)]:
        t, lp = cpu.chain(root, k, v, valid, 9, 5, 2, min_logp=th)
        assert t.shape == (kept, 2) and torch.equal(t, tokens[:kept]), th
        torch.testing.assert_close(lp, logp[:kept])


def test_tree_selection_leaves_out_unlikely_drafts():
    """EagleProposer._select with min_prob: candidates below it are dropped, the
    best one stays even when every candidate is below it."""
    import math
    import types
    from slipstream.spec.eagle import EagleProposer
    tokens = torch.tensor([[5, 6], [7, 8], [9, 10]])
    logp = torch.log(torch.tensor([[0.8, 0.1], [0.5, 0.3], [0.5, 0.2]]))
    table = chain_table(tokens, logp)                     # paths 0.8, 0.1, 0.4, 0.24, 0.2, 0.08
    for p, want in ((0.0, [5, 6, 7, 8, 9, 10]), (0.3, [5, 7]), (0.21, [5, 7, 8]), (0.9, [5])):
        me = types.SimpleNamespace(max_nodes=6, min_logp=math.log(p) if p else -math.inf)
        tree = EagleProposer._select(me, table)
        assert sorted(tree.tokens.tolist()) == sorted(want), p


def test_sampled_chain_draws_from_the_heads_softmax():
    """sample_chain: each level's q is the softmax of the draft logits at the
    temperature (its largest entry at temperature 1 is the argmax chain's
    probability), the drawn token is a draft-vocabulary token q gives mass, a seed
    repeats the chain, a near-zero temperature draws the argmax chain, and the first
    level's draws follow q."""
    _, lm_head, _, cpu, g = _setup(seed=4)
    k, v, valid = _past(g, 9)
    root = torch.randn(H, generator=g)
    greedy, logp = cpu.chain(root, k, v, valid, 9, 4, 1)
    tokens, q = cpu.sample_chain(root, k, v, valid, 9, 4, 1.0, torch.Generator().manual_seed(1))
    assert tokens.shape == (4,) and q.shape == (4, cpu.vocab.shape[0])
    torch.testing.assert_close(q.sum(1), torch.ones(4))
    torch.testing.assert_close(q[0].max().log(), logp[0, 0], atol=1e-5, rtol=1e-5)
    for level, t in enumerate(tokens.tolist()):
        col = (cpu.vocab == t).nonzero()[:, 0]
        assert len(col) == 1 and q[level, col[0]] > 0
    again, _ = cpu.sample_chain(root, k, v, valid, 9, 4, 1.0, torch.Generator().manual_seed(1))
    assert torch.equal(again, tokens)
    cold, _ = cpu.sample_chain(root, k, v, valid, 9, 4, 1e-3, torch.Generator().manual_seed(2))
    assert torch.equal(cold, greedy[:, 0])
    gen = torch.Generator().manual_seed(3)
    n = 4000
    firsts = torch.tensor([int(cpu.sample_chain(root, k, v, valid, 9, 1, 1.0, gen)[0][0])
                           for _ in range(n)])
    cols = (firsts[:, None] == cpu.vocab[None, :]).float().argmax(1)
    freq = torch.bincount(cols, minlength=q.shape[1]).double() / n
    tol = 5 * (q[0].double() * (1 - q[0].double()) / n).sqrt() + 3 / n   # (+3 draws: rare columns)
    assert torch.all((freq - q[0].double()).abs() <= tol)
    with pytest.raises(ValueError, match="temperature"):
        cpu.sample_chain(root, k, v, valid, 9, 4, 0.0)

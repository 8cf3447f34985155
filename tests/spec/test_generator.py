"""Speculative generation with every proposer is token-identical to plain
greedy decoding (and, with a draft that is the target itself, accepts all)."""
import pytest
import torch

from slipstream.sampling_params import SamplingParams
from slipstream.spec.draft_model import DraftModelProposer
from slipstream.spec.generator import SpecStats, SpeculativeGenerator
from slipstream.spec.ngram import NgramProposer
from slipstream.spec.tree import DraftTree

PROMPTS = [[1, 5, 9, 5, 9, 5], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [42]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


class RandomTreeProposer:
    """Random trees (branching, repeated sibling tokens): exercises tree
    verification and the K/V moves of accepted paths. Every other draft
    token is taken from a model's greedy continuation so that some paths
    are accepted."""
    needs_hidden = False

    def __init__(self, vocab, oracle=None, seed=0):
        self.g = torch.Generator().manual_seed(seed)
        self.vocab, self.oracle = vocab, oracle

    def propose(self, requests):
        out = []
        for r in requests:
            n = int(torch.randint(0, 8, (), generator=self.g))
            parents = [int(torch.randint(-1, j, (), generator=self.g)) for j in range(n)]
            tokens = torch.randint(0, self.vocab, (n,), generator=self.g)
            if self.oracle is not None and n:
                # Make the first branch follow the oracle's greedy path.
                guess = self.oracle(list(r.token_ids), n)
                chain = [0]
                for j in range(1, n):
                    if parents[j] == chain[-1]:
                        chain.append(j)
                for d, j in enumerate(chain):
                    tokens[j] = guess[d]
            out.append(DraftTree(tokens, tuple(parents)))
        return out

    def release(self, rid):
        pass


@pytest.fixture(scope="module")
def plain(tiny_target):
    return SpeculativeGenerator(tiny_target, None, num_blocks=64, block_size=4).generate(
        PROMPTS, GREEDY)


def _oracle(reference):
    def guess(tokens, n):
        for prompt, out in zip(PROMPTS, reference):
            full = prompt + out
            if full[:len(tokens)] == tokens:
                return full[len(tokens):len(tokens) + n] + [0] * n
        return [0] * n
    return guess


def test_ngram_greedy_is_plain_greedy(tiny_target, plain):
    stats = SpecStats()
    gen = SpeculativeGenerator(tiny_target, NgramProposer(3, max_n=3), num_blocks=64, block_size=4)
    assert gen.generate(PROMPTS, GREEDY, stats) == plain
    assert stats.drafted > 0


def test_draft_model_greedy_is_plain_greedy(tiny_target, tiny_draft, plain):
    stats = SpecStats()
    gen = SpeculativeGenerator(tiny_target, DraftModelProposer(tiny_draft, 4, 64, 4),
                               num_blocks=64, block_size=4)
    assert gen.generate(PROMPTS, GREEDY, stats) == plain
    assert stats.drafted > 0


def test_self_draft_accepts_everything(tiny_target, plain):
    stats = SpecStats()
    draft = DraftModelProposer(tiny_target.__class__(tiny_target.config, tiny_target.backend.__class__()), 3, 64, 4)
    draft.model.load_state_dict(tiny_target.state_dict())
    gen = SpeculativeGenerator(tiny_target, draft, num_blocks=64, block_size=4)
    assert gen.generate(PROMPTS, GREEDY, stats) == plain
    assert stats.accepted == stats.drafted and stats.tau > 3.5


def test_random_trees_greedy_is_plain_greedy(tiny_target, plain, monkeypatch):
    from slipstream.spec import generator
    moved = []
    real = generator.apply_kv_moves

    def counting(pool, table, bs, ctx, moves):
        moved.extend(moves)
        real(pool, table, bs, ctx, moves)
    monkeypatch.setattr(generator, "apply_kv_moves", counting)
    stats = SpecStats()
    gen = SpeculativeGenerator(tiny_target, RandomTreeProposer(96, _oracle(plain)),
                               num_blocks=64, block_size=4)
    assert gen.generate(PROMPTS, GREEDY, stats) == plain
    assert stats.accepted > stats.rounds // 2 and len(moved) > 5
    # Without the moves the kept K/V would be a rejected branch's: outputs change.
    monkeypatch.setattr(generator, "apply_kv_moves", lambda *a: None)
    gen = SpeculativeGenerator(tiny_target, RandomTreeProposer(96, _oracle(plain)),
                               num_blocks=64, block_size=4)
    assert gen.generate(PROMPTS, GREEDY) != plain


def _eagle_for(target, seed=0):
    from slipstream.spec.eagle import EagleHead, EagleProposer, EagleShape
    c = target.config
    torch.manual_seed(seed)
    head = EagleHead(EagleShape(c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
                                c.head_dim, 64, c.rope_theta, c.max_position_embeddings)).eval()
    return EagleProposer(head, target.model.embed_tokens, target.compute_logits,
                         depth=4, topk=3, beam=2, max_nodes=8)


def test_eagle_dynamic_tree_greedy_is_plain_greedy(tiny_target, plain):
    stats = SpecStats()
    proposer = _eagle_for(tiny_target)
    gen = SpeculativeGenerator(tiny_target, proposer, num_blocks=64, block_size=4)
    assert gen.generate(PROMPTS, GREEDY, stats) == plain
    assert stats.drafted == 8 * stats.rounds and stats.accepted > 0
    assert not proposer.kv   # released


def test_medusa_static_tree_greedy_is_plain_greedy(tiny_target, plain):
    from slipstream.spec.medusa import MedusaHeads, MedusaProposer
    torch.manual_seed(0)
    heads = MedusaHeads(tiny_target.config.hidden_size, 3)
    heads.w2.data.normal_(0, 0.05)
    stats = SpecStats()
    gen = SpeculativeGenerator(tiny_target, MedusaProposer(heads, tiny_target.compute_logits,
                                                           (3, 2, 1)),
                               num_blocks=64, block_size=4)
    assert gen.generate(PROMPTS, GREEDY, stats) == plain
    assert stats.drafted == (3 + 6 + 6) * stats.rounds and stats.accepted > 0


def test_sampling_with_seed_is_reproducible_and_runs_every_proposer(tiny_target, tiny_draft):
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, seed=3, ignore_eos=True)
    for make in (lambda: NgramProposer(3), lambda: DraftModelProposer(tiny_draft, 3, 64, 4),
                 lambda: _eagle_for(tiny_target)):
        a = SpeculativeGenerator(tiny_target, make(), 64, 4).generate(PROMPTS[:2], params)
        b = SpeculativeGenerator(tiny_target, make(), 64, 4).generate(PROMPTS[:2], params)
        assert a == b and all(len(o) == 8 for o in a)


def test_two_caches_on_one_model_do_not_collide(tiny_target, plain):
    from slipstream.spec.train_data import features_of
    a = SpeculativeGenerator(tiny_target, None, num_blocks=64, block_size=4)
    features_of(tiny_target, torch.tensor(PROMPTS[1]))   # binds the layers to its own pool
    assert a.generate(PROMPTS, GREEDY) == plain


def test_reference_loop_refuses_what_it_does_not_apply(tiny_target):
    gen = SpeculativeGenerator(tiny_target, None, num_blocks=64, block_size=4)
    for params in (SamplingParams(temperature=0, max_tokens=4, repetition_penalty=1.2),
                   SamplingParams(temperature=0, max_tokens=4, logit_bias={5: 1.0}),
                   SamplingParams(temperature=0, max_tokens=4, min_tokens=2)):
        with pytest.raises(ValueError, match="reference loop"):
            gen.generate([[5, 6, 7]], params)

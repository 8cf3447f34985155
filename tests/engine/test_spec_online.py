"""Online adaptation of an EAGLE head (spec/online.py): the head keeps training
on the pairs it drafted from while the engine serves. Outputs stay exactly
plain greedy decoding; acceptance on the prompts it has seen goes up."""
import pytest
import torch

from slipstream import SamplingParams
from slipstream.spec.online import _segments
from tests.engine.conftest import assert_no_leak, make_llm

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def test_segments_keep_the_accepted_pairs_and_split_at_gaps():
    f = torch.arange(20.0).view(10, 2)
    parts = [(0, torch.tensor([5, 6, 7]), f[:3], None),
             (3, torch.tensor([8, 9, 1, 1]), f[3:7], torch.tensor([True, True, False, False])),
             (5, torch.tensor([10]), f[7:8], None),          # follows the accepted two
             (9, torch.tensor([11, 12]), f[8:10], None)]     # a gap: a new run
    (t1, r1), (t2, r2) = _segments(parts)
    assert t1.tolist() == [0, 5, 6, 7, 8, 9, 10] and torch.equal(r1, torch.cat([f[:5], f[7:8]]))
    assert t2.tolist() == [0, 11, 12] and torch.equal(r2, f[8:10])


@pytest.fixture(scope="module")
def folder(tiny_folder):
    return tiny_folder("llama")[0]


def _head(folder, tmp_path):
    from slipstream.loader import open_model
    from slipstream.spec.eagle import EagleHead, EagleShape
    c = open_model(str(folder)).config
    torch.manual_seed(0)
    path = tmp_path / "e.safetensors"
    EagleHead(EagleShape(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                         64, c.rope_theta, c.max_position_embeddings)).save(path)
    return path


def _acceptance(llm, prompts) -> tuple[float, list]:
    st = llm.engine.runner.speculator.stats
    st.__init__()
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    return st.accepted / max(st.drafted, 1), outs


def test_online_adaptation_raises_acceptance_and_stays_exact(folder, tmp_path):
    prompts = [{"prompt_token_ids": [5 + i, 9, 14 + i, 3, 7] * 2} for i in range(4)]
    plain = [o.outputs[0].token_ids for o in make_llm(folder).generate(prompts, GREEDY, use_tqdm=False)]
    llm = make_llm(folder, speculative_method="eagle", speculative_model=str(_head(folder, tmp_path)),
                   num_speculative_tokens=3, speculative_tree="2,2,4", speculative_auto_off=False,
                   speculative_online=True)
    online = llm.engine.runner.speculator.proposer.online
    assert online is not None
    online.every, online.steps = 64, 8
    for g in online.opt.param_groups:     # a random head: learn fast enough for a test
        g["lr"] = 3e-3
    before, outs = _acceptance(llm, prompts)
    assert outs == plain and online.stats["updates"] == 0
    for _ in range(6):
        _, outs = _acceptance(llm, prompts)
        assert outs == plain
    after, outs = _acceptance(llm, prompts)
    assert outs == plain
    assert online.stats["updates"] >= 3 and online.stats["last_loss"] is not None
    assert after > before + 0.2, (before, after)
    assert_no_leak(llm)


def test_online_adaptation_needs_an_eagle_head(folder):
    with pytest.raises(ValueError, match="speculative_online"):
        make_llm(folder, speculative_method="ngram", speculative_online=True)

"""The CPU chain loop (spec/cpu_loop.py) emits plain greedy decoding's tokens, text,
finish reasons and stops, with the shipped EAGLE head on the default model, prefix
cache hits included; it gives its blocks back and is counted by the speculator.
Sampled requests draw from plain sampling's distribution."""
import pytest
import torch

from slipstream import LLM, SamplingParams
from slipstream.kernels import cpu_library
from slipstream.spec.cpu_loop import CPUChainLoop

pytestmark = pytest.mark.skipif(cpu_library.load() is None, reason="no C compiler for the CPU kernels")

TEXTS = ["Write a haiku about the sea.", "List five uses of a paper clip and say why each works."]
KW = dict(device="cpu", max_model_len=256, seed=0, kv_cache_memory=64 << 20)
CHAIN = dict(speculative_method="eagle", num_speculative_tokens=3, speculative_tree="1,1,3",
             speculative_device_loop=True)


@pytest.fixture(scope="module")
def plain():
    return LLM(**KW)


@pytest.fixture(scope="module")
def spec():
    return LLM(**KW, **CHAIN)


def _chat(llm, text):
    tok = llm.get_tokenizer()
    return {"prompt_token_ids": tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]),
                                           add_special_tokens=False)}


def _same(a, b):
    return (a.token_ids, a.text, a.finish_reason, a.stop_reason) == (
        b.token_ids, b.text, b.finish_reason, b.stop_reason)


def test_chain_loop_is_plain_greedy_decoding(plain, spec):
    """Both engines keep their prefix caches: the second prompt and every repeat
    start from cached blocks of the chat template (and of themselves)."""
    cases = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
             SamplingParams(temperature=0.0, max_tokens=40),
             SamplingParams(temperature=0.0, max_tokens=40, stop=[" the"]),
             SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[28]),
             SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
             SamplingParams(temperature=0.0, max_tokens=1)]
    pool = spec.engine.scheduler.kv.pool
    for text in TEXTS:
        prompt = _chat(spec, text)
        for params in cases:
            free = pool.num_free_blocks
            want = plain.generate(prompt, params, use_tqdm=False)[0].outputs[0]
            got = spec.generate(prompt, params, use_tqdm=False)[0].outputs[0]
            assert _same(got, want), (text, params)
            assert pool.num_free_blocks == free             # blocks given back
    loop = spec.engine.loop_path().loop
    assert isinstance(loop, CPUChainLoop) and loop.rounds > 0
    st = spec.engine.spec_stats
    assert st.rounds >= loop.rounds and st.tau > 1.2          # drafts were accepted
    assert st.drafted < 3 * st.rounds                          # chains cut short near max_tokens


def test_prefix_hits_start_the_heads_context_after_them(spec):
    """A repeated prompt reuses its cached blocks: the loop computes only its
    last block's tokens, and the head's context starts there."""
    loop_path = spec.engine.loop_path()
    prompt = _chat(spec, "Name three primary colors and one secondary color.")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    first = spec.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    again = spec.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    p, bs = len(prompt["prompt_token_ids"]), spec.engine.config.cache.block_size
    assert loop_path.loop._h0 == (p - 1) // bs * bs > 0
    assert again == first


def test_other_requests_take_the_engine(spec):
    """Penalties, several prompts and trees wider than a chain keep their paths."""
    loop = spec.engine.loop_path()
    spec.generate(_chat(spec, TEXTS[0]), SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    rounds = loop.loop.rounds
    spec.generate([_chat(spec, t) for t in TEXTS], SamplingParams(temperature=0.0, max_tokens=8),
                  use_tqdm=False)
    spec.generate(_chat(spec, TEXTS[0]), SamplingParams(temperature=0.8, seed=1, max_tokens=8,
                                                        repetition_penalty=1.2), use_tqdm=False)
    assert loop.loop.rounds == rounds
    tree = LLM(**KW, **{**CHAIN, "speculative_tree": "2,2,4"})
    tree.generate(_chat(tree, TEXTS[0]), SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert not isinstance(tree.engine.loop_path().loop, CPUChainLoop)


def test_positions_up_to_the_model_length(plain, spec):
    """A generation ending at max_model_len: the last chains are cut to stay inside it."""
    prompt = _chat(spec, TEXTS[1])
    params = SamplingParams(temperature=0.0, max_tokens=256 - len(prompt["prompt_token_ids"]),
                            ignore_eos=True)
    want = plain.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    got = spec.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert _same(got, want) and len(got.token_ids) == params.max_tokens


def test_an_eagle3_head_reads_the_targets_taps(tmp_path):
    """A random head over layers 2, 15 and 27: the prompt's and the rounds' rows
    carry the taps the head reads; tokens stay plain decoding's. (No prefix caches
    here: a prompt computed after a hit may differ in its last bits from one computed
    whole, and the engines below would not have the same hits.)"""
    plain = LLM(**KW, enable_prefix_caching=False)
    from slipstream.spec.eagle_head import EagleHead
    from slipstream.spec.train import eagle_shape_for
    torch.manual_seed(0)
    config = plain.engine.runner.model.config
    EagleHead(eagle_shape_for(config, 128, (2, 15, 27))).save(
        tmp_path / "e3.safetensors", draft_vocab=torch.arange(0, config.vocab_size, 3)[:4096])
    llm = LLM(**KW, **CHAIN, speculative_model=str(tmp_path / "e3.safetensors"),
              enable_prefix_caching=False)
    assert llm.engine.runner.model.model.feature_taps == (2, 15, 27)
    prompt = _chat(llm, TEXTS[0])
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = plain.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == want
    assert isinstance(llm.engine.loop_path().loop, CPUChainLoop)
    from slipstream.spec import cpu_draft
    if cpu_draft.BITS is None:       # a head from a file drafts from 8-bit copies
        assert llm.engine.runner.speculator.proposer.head.q.qm.segments[0][0] == cpu_draft.Q8_0


def test_chains_stop_below_the_draft_probability():
    """speculative_draft_min_prob: chains as long as the head stays confident (up to
    6 here), none where it is not; tokens stay plain decoding's (fresh engines
    without prefix caches, as in the test above)."""
    plain = LLM(**KW, enable_prefix_caching=False)
    llm = LLM(**KW, **{**CHAIN, "num_speculative_tokens": 6, "speculative_tree": "1,1,6"},
              speculative_draft_min_prob=0.3, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    drafted = []
    for text in TEXTS:
        prompt = _chat(llm, text)
        want = plain.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
        assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == want
        drafted += llm.engine.loop_path().loop.drafted
    assert min(drafted) < max(drafted) <= 6 and len(set(drafted)) > 2


def test_sampled_one_hot_distributions_are_greedy(plain, spec):
    """top_k 1 or a tiny top_p leave one token a row: the sampled loop (its draws, its
    verifier) must then give plain greedy decoding's tokens, drafts accepted."""
    prompt = _chat(spec, TEXTS[1])
    want = plain.generate(prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    loop = spec.engine.loop_path()
    for params in (SamplingParams(temperature=0.8, top_k=1, max_tokens=40, ignore_eos=True),
                   SamplingParams(temperature=1.2, top_p=1e-4, max_tokens=40, ignore_eos=True, seed=3)):
        got = spec.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
        assert got == want, params
        assert isinstance(loop.loop, CPUChainLoop) and sum(loop.loop.accepted) > 0


def test_drafts_drawn_from_the_head_keep_one_hot_distributions_greedy(plain, spec, monkeypatch):
    """SLIPSTREAM_CPU_SAMPLED_DRAFTS=1 (chains drawn from the head's softmax, accepted
    with min(1, p / q)): with top_k 1 every row's p is one-hot, so the loop must still
    give plain greedy decoding's tokens."""
    from slipstream.spec import cpu_loop
    monkeypatch.setattr(cpu_loop, "SAMPLED_DRAFTS", True)
    prompt = _chat(spec, TEXTS[0])
    want = plain.generate(prompt, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    got = spec.generate(prompt, SamplingParams(temperature=0.9, top_k=1, max_tokens=32, ignore_eos=True,
                                               seed=4), use_tqdm=False)[0].outputs[0].token_ids
    assert got == want and sum(spec.engine.loop_path().loop.accepted) > 0


def test_sampled_seeds_repeat_and_draws_follow_plain_sampling(plain, spec):
    """A seed gives the same tokens twice; over many seeds the first two tokens (the
    second through the verifier's accept / reject of a draft) are distributed as
    plain sampling's: a two-sample chi-square over their top-3 outcomes. (A check of
    the loop's wiring: with 150 draws it cannot see a subtly lossy rule; the walk's
    own tests in test_verify.py can.)"""
    prompt = _chat(spec, "Finish the sentence: my favourite animal is")
    params = dict(temperature=1.0, top_k=3, max_tokens=2, ignore_eos=True)
    first = [spec.generate(prompt, SamplingParams(**params, seed=5), use_tqdm=False)[0].outputs[0].token_ids
             for _ in range(2)]
    assert first[0] == first[1]
    n = 150
    counts = []
    for llm in (plain, spec):
        outs = llm.generate(prompt, SamplingParams(**params, seed=0), use_tqdm=False)   # warm-up
        seen = {}
        for s in range(n):
            ids = tuple(llm.generate(prompt, SamplingParams(**params, seed=1000 + s),
                                     use_tqdm=False)[0].outputs[0].token_ids)
            seen[ids] = seen.get(ids, 0) + 1
        counts.append(seen)
    assert spec.engine.loop_path().loop.rounds > 0 and outs
    keys = sorted(set(counts[0]) | set(counts[1]))
    a = torch.tensor([counts[0].get(k, 0) for k in keys], dtype=torch.float64)
    b = torch.tensor([counts[1].get(k, 0) for k in keys], dtype=torch.float64)
    keep = (a + b) >= 5                        # pool the rare outcomes
    a = torch.cat([a[keep], a[~keep].sum()[None]])
    b = torch.cat([b[keep], b[~keep].sum()[None]])
    used = (a + b) > 0
    a, b = a[used], b[used]
    expected_a = (a + b) / 2
    stat = float((((a - expected_a) ** 2 + (b - expected_a) ** 2) / expected_a).sum())
    dof = len(a) - 1
    p = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                      torch.tensor(stat / 2, dtype=torch.float64)))
    assert dof >= 2 and p > 1e-3, (counts, p)

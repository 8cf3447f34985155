"""Speculative decoding in the engine: greedy outputs are token-identical to
plain decoding for every method, in batches whose requests accept different
numbers of drafts in the same step; no KV block leaks."""
import pytest
import torch

from slipstream import SamplingParams
from tests.engine.conftest import assert_no_leak, make_llm, random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def _prompts():
    # Repetitive prompts (prompt lookup finds continuations) and random ones.
    rep = [{"prompt_token_ids": [5, 6, 7, 8, 9] * 4}, {"prompt_token_ids": [11, 12, 13] * 5 + [11]}]
    return rep + random_prompts(3, 100, 3, 30, seed=2)


@pytest.fixture(scope="module")
def folder(tiny_folder):
    return tiny_folder("llama")[0]


@pytest.fixture(scope="module")
def plain(folder):
    llm = make_llm(folder)
    return [o.outputs[0].token_ids for o in llm.generate(_prompts(), GREEDY, use_tqdm=False)]


def _heads(tmp_path, folder):
    from slipstream.spec.eagle import EagleHead, EagleShape
    from slipstream.spec.medusa import MedusaHeads
    from slipstream.loader import open_model
    c = open_model(str(folder)).config
    torch.manual_seed(0)
    medusa = MedusaHeads(c.hidden_size, 3)
    medusa.w2.data.normal_(0, 0.02)
    medusa.save(tmp_path / "m.safetensors")
    for name, parallel, layers in (("e", 0, ""), ("p", 1, ""), ("e3", 0, "0,1")):
        EagleHead(EagleShape(c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
                             c.head_dim, 64, c.rope_theta, c.max_position_embeddings,
                             parallel=parallel, feature_layers=layers)
                  ).save(tmp_path / f"{name}.safetensors")
    return tmp_path / "m.safetensors", tmp_path / "e.safetensors"


@pytest.mark.parametrize("method", ["ngram", "draft", "draft-self", "medusa", "eagle",
                                    "eagle-chunked", "peagle", "eagle-3"])
def test_greedy_speculation_equals_plain_decoding(folder, plain, method, tmp_path):
    kw = dict(speculative_method=method.split("-")[0], num_speculative_tokens=3,
              speculative_auto_off=False)
    if method == "eagle-chunked":  # prompt chunks share steps with drafts: trees cut to chains
        kw.update(max_num_batched_tokens=24)
    if method == "draft":
        kw.update(speculative_model=str(folder), speculative_draft_layers=1)
    elif method == "draft-self":   # the target drafts for itself: every draft is accepted
        kw.update(speculative_model=str(folder))
    elif method == "peagle":   # one head pass drafts the 3 tokens (a P-EAGLE head)
        _heads(tmp_path, folder)
        kw.update(speculative_model=str(tmp_path / "p.safetensors"))
    elif method == "eagle-3":  # the head reads the target's layers 0 and 1 (feature taps)
        _heads(tmp_path, folder)
        kw.update(speculative_model=str(tmp_path / "e3.safetensors"), speculative_tree="3,2,6")
    elif method.startswith(("medusa", "eagle")):
        m, e = _heads(tmp_path, folder)
        kw.update(speculative_model=str(m if method == "medusa" else e),
                  speculative_tree="2,2,1" if method == "medusa" else "3,2,6")
    llm = make_llm(folder, **kw)
    outs = llm.generate(_prompts(), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain
    stats = llm.engine.runner.speculator.stats
    assert stats.rounds > 0 and stats.drafted > 0
    per_step = stats.emitted / stats.rounds
    if method == "draft-self":
        assert stats.accepted == stats.drafted and per_step > 3.5
    if method == "ngram":
        assert stats.accepted > 0
    if method == "eagle-3":
        assert llm.engine.runner.model.model.feature_taps == (0, 1)
    assert_no_leak(llm)


def test_ragged_acceptance_in_one_batch(folder, plain):
    """Requests accepting different numbers of drafts share steps: n-gram
    drafts hit on the repetitive prompts and miss on the random ones. Each
    request still gets exactly its plain greedy tokens."""
    from slipstream.spec import speculator
    seen = []
    real = speculator.Speculator.verify

    def spy(self, plan, hidden):
        out = real(self, plan, hidden)
        emitted = out[0]
        if len(emitted) > 1:
            seen.append(sorted(len(v) for v in emitted.values()))
        return out
    speculator.Speculator.verify = spy
    try:
        llm = make_llm(folder, speculative_method="ngram", num_speculative_tokens=4,
                       speculative_auto_off=False)
        outs = llm.generate(_prompts(), GREEDY, use_tqdm=False)
    finally:
        speculator.Speculator.verify = real
    assert [o.outputs[0].token_ids for o in outs] == plain
    # Some step verified several requests that emitted different numbers of tokens.
    assert any(len(set(s)) > 1 for s in seen)


@pytest.mark.parametrize("method", ["ngram", "eagle"])
def test_logprobs_under_speculation_equal_plain_decoding(folder, method, tmp_path):
    """A request that asks for log-probabilities speculates too: each emitted
    token's log-probability, rank and top alternatives come from its verified
    row and equal plain decoding's; a stop string inside a multi-token step
    keeps one record per kept token."""
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=3)
    kw = dict(speculative_method=method, num_speculative_tokens=3, speculative_auto_off=False)
    if method == "eagle":
        _, e = _heads(tmp_path, folder)
        kw.update(speculative_model=str(e), speculative_tree="3,2,6")
    plain = make_llm(folder).generate(_prompts(), params, use_tqdm=False)
    llm = make_llm(folder, **kw)
    outs = llm.generate(_prompts(), params, use_tqdm=False)
    stats = llm.engine.runner.speculator.stats
    assert stats.rounds > 0 and stats.accepted > 0
    for o, p in zip(outs, plain):
        a, b = o.outputs[0], p.outputs[0]
        assert a.token_ids == b.token_ids
        assert len(a.logprobs) == len(a.token_ids) == 20
        for tok, x, y in zip(a.token_ids, a.logprobs, b.logprobs):
            assert list(x) == list(y) and len(x) in (3, 4) and tok in x
            for t in x:
                assert x[t].rank == y[t].rank
                assert x[t].logprob == pytest.approx(y[t].logprob, abs=1e-4)
        assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=1e-3)
    assert_no_leak(llm)
    # A stop string that ends the answer inside a step: one record per kept token.
    text = outs[0].outputs[0].text
    cut = text[:len(text) // 2]
    stop = llm.generate([_prompts()[0]], SamplingParams(
        temperature=0.0, max_tokens=20, logprobs=1, stop=[cut[-3:]] if len(cut) >= 3 else None),
        use_tqdm=False)[0].outputs[0]
    assert len(stop.logprobs) == len(stop.token_ids)


@pytest.mark.parametrize("method", ["ngram", "eagle"])
def test_penalties_and_logit_bias_under_speculation_equal_plain_decoding(folder, method, tmp_path):
    """Requests with penalties and logit bias speculate, and each verification row
    is judged by the logits plain decoding would sample from after that row's
    path: greedy tokens equal plain decoding's (the penalty counts also take the
    tokens of multi-token steps)."""
    base = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, repetition_penalty=1.3,
                             frequency_penalty=0.3, presence_penalty=0.2),
              SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                             logit_bias={7: 2.5, 101: -50.0}),
              SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, frequency_penalty=0.5,
                             logit_bias={9: 1.0}),
              base, base]
    kw = dict(speculative_method=method, num_speculative_tokens=3, speculative_auto_off=False)
    if method == "eagle":
        _, e = _heads(tmp_path, folder)
        kw.update(speculative_model=str(e), speculative_tree="3,2,6")
    plain = [o.outputs[0].token_ids for o in make_llm(folder).generate(_prompts(), params,
                                                                       use_tqdm=False)]
    llm = make_llm(folder, **kw)
    results = llm.generate(_prompts(), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in results] == plain
    stats = llm.engine.runner.speculator.stats
    assert stats.rounds > 0 and stats.drafted > 0
    # Each request's output counts its own drafts; together they are the engine's.
    assert sum(o.extra["num_draft_tokens"] for o in results) == stats.drafted
    assert sum(o.extra["num_accepted_tokens"] for o in results) == stats.accepted
    if method == "ngram":
        assert stats.accepted > 0
    assert_no_leak(llm)


def test_sampling_with_speculation_is_seeded_and_complete(folder):
    params = SamplingParams(temperature=0.9, top_k=20, max_tokens=12, seed=7, ignore_eos=True)
    a = make_llm(folder, speculative_method="ngram", speculative_auto_off=False)
    b = make_llm(folder, speculative_method="ngram", speculative_auto_off=False)
    ra = [o.outputs[0].token_ids for o in a.generate(_prompts(), params, use_tqdm=False)]
    rb = [o.outputs[0].token_ids for o in b.generate(_prompts(), params, use_tqdm=False)]
    assert ra == rb and all(len(t) == 12 for t in ra)
    assert_no_leak(a)


def test_speculative_options_are_checked(folder):
    with pytest.raises(ValueError, match="speculative_method"):
        make_llm(folder, speculative_method="lookahead")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        make_llm(folder, speculative_method="ngram", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="speculative_tree"):
        make_llm(folder, speculative_method="eagle", speculative_tree="3,2")
    with pytest.raises(ValueError, match="at most 63"):
        make_llm(folder, speculative_method="medusa", speculative_tree="4,4,4")
    # The shipped heads are the default model's: another model names its own
    for method in ("medusa", "eagle", "peagle"):
        with pytest.raises(ValueError, match=f"no shipped {method} heads.*speculative_model=PATH"):
            make_llm(folder, speculative_method=method)
    with pytest.raises(ValueError, match="'draft' needs speculative_model"):
        make_llm(folder, speculative_method="draft")


@pytest.mark.parametrize("method", ["ngram", "eagle"])
def test_async_steps_while_speculation_is_off_stay_exact(folder, plain, method, tmp_path):
    """With async scheduling allowed, steps the governor leaves plain overlap;
    switching between overlapped plain steps and speculating steps (probes)
    keeps every output token-identical."""
    kw = dict(speculative_method=method, num_speculative_tokens=3, async_scheduling=True)
    if method == "eagle":
        kw.update(speculative_model=str(_heads(tmp_path, folder)[1]), speculative_tree="3,2,6")
    llm = make_llm(folder, **kw)
    spec = llm.engine.runner.speculator
    gov = spec.governor
    gov._probe_interval = lambda batch: 3   # probes often: many switches in 20 tokens
    overlapped = []
    real = spec.wants_overlap
    spec.wants_overlap = lambda n: overlapped.append(real(n)) or overlapped[-1]
    # Measurements that make the rule say off (nothing accepted, verification
    # 1.5x a plain step) while a better draft could still pay (so probes run).
    gov.observe_round(1, 1, 3); gov.observe_draft(0.001)
    for b in (1, 2, 4, 8):
        gov.observe_step(0.015, b, "spec"); gov.observe_step(0.01, b, "plain")
    outs = llm.generate(_prompts(), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert any(overlapped) and not all(overlapped)
    assert spec.stats.rounds > 0            # probe rounds verified drafts
    assert_no_leak(llm)


def test_single_request_tree_steps_take_the_graph_path_exactly(folder, tmp_path):
    """The CUDA-graph path for one request verifying a tree (static inputs,
    the tree mask in a per-size buffer, chains as trees) gives the eager
    outputs; on the CPU a stand-in runs the forward where a graph would replay."""
    m, e = _heads(tmp_path, folder)
    prompts = _prompts()[:2]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in make_llm(folder).generate(prompts, params,
                                                                        use_tqdm=False)]
    for kw in (dict(speculative_method="eagle", speculative_model=str(e),
                    speculative_tree="3,2,6"),
               dict(speculative_method="ngram")):
        llm = make_llm(folder, num_speculative_tokens=3, speculative_auto_off=False, **kw)
        runner = llm.engine.runner
        seen = []

        class Graphs:
            def bucket_for(self, n):
                return None

            def run_tree(self, batch):
                assert batch.tree_mask is not None and batch.block_tables.shape[0] == 1
                seen.append(batch.input_ids.shape[0])
                runner.backend.prepare(batch)
                return runner.model(batch)

        runner.graphs = Graphs()
        got = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
        assert got == want and seen
        assert_no_leak(llm)


def test_accepted_side_branches_move_their_kv_in_batched_steps(folder, plain, monkeypatch):
    """An oracle tree whose first child is always wrong and whose second
    branch holds the true continuation: every accepted path leaves the
    leftmost branch, so its K/V must move into place, for several requests
    of a step at once (the ones near max_tokens get cut trees)."""
    import numpy as np
    from slipstream.spec import base, speculator
    from slipstream.spec.tree import DraftTree
    prompts = [p["prompt_token_ids"] for p in _prompts()]

    class Oracle:
        needs_hidden = False

        def propose(self, reqs):
            out = []
            for r in reqs:
                ids = list(np.asarray(r.token_ids))
                i = next(i for i, p in enumerate(prompts) if ids[:len(p)] == p)
                done = len(ids) - len(prompts[i])
                nxt = plain[i][done:done + 3]
                if len(nxt) < 3:
                    out.append(DraftTree.empty())
                    continue
                wrong = [(t + 1) % 100 for t in nxt]
                out.append(DraftTree(torch.tensor([wrong[0], nxt[0], wrong[1], nxt[1], nxt[2]]),
                                     (-1, -1, 1, 1, 3)))
            return out

        def release(self, rid):
            pass

    monkeypatch.setitem(base._PROPOSERS, "ngram", lambda **_: Oracle())
    moved = []
    real = speculator.move_kv
    monkeypatch.setattr(speculator, "move_kv",
                        lambda pools, s, d, dev: (moved.append(len(s)), real(pools, s, d, dev)))
    llm = make_llm(folder, speculative_method="ngram", num_speculative_tokens=5,
                   speculative_auto_off=False)
    outs = llm.generate(_prompts(), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain
    stats = llm.engine.runner.speculator.stats
    assert stats.accepted >= 3 * stats.rounds - 3 * len(prompts)   # nearly every path taken
    assert moved and max(moved) >= 3 * 2                            # several requests per step
    assert_no_leak(llm)


@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_drafting_right_after_verification_equals_drafting_later(folder, plain, method,
                                                                 tmp_path, monkeypatch):
    """Medusa and EAGLE draft on the device before the round's one wait
    (EAGLE runs all D + 1 possible new pairs, the rejected ones masked): the
    same trees as drafting from the kept states after the wait."""
    from slipstream.spec import eagle, medusa
    m, e = _heads(tmp_path, folder)
    kw = dict(speculative_method=method, num_speculative_tokens=3, speculative_auto_off=False,
              speculative_model=str(m if method == "medusa" else e),
              speculative_tree="2,2,1" if method == "medusa" else "3,2,6")
    cls = medusa.MedusaProposer if method == "medusa" else eagle.EagleProposer
    finished = []
    real = cls.finish_drafts
    monkeypatch.setattr(cls, "finish_drafts",
                        lambda self, *a: finished.append(1) or real(self, *a))
    runs = []
    for early in (True, False):
        if not early:
            monkeypatch.setattr(cls, "draft_after_verify", lambda self, *a: None)
        llm = make_llm(folder, **kw)
        outs = llm.generate(_prompts(), GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == plain
        st = llm.engine.runner.speculator.stats
        runs.append((st.rounds, st.drafted, st.accepted, st.accepted_at, st.drafted_at))
        if early:
            assert len(finished) > st.rounds // 2     # most rounds drafted early
    assert runs[0] == runs[1] and runs[0][2] > 0


def test_cut_drafts_keep_a_few_sizes():
    """Drafts cut by max_tokens or the context keep one of a few sizes (each
    row count is a verification graph of its own); uncut drafts stay whole."""
    from types import SimpleNamespace
    from slipstream.engine.scheduler import Scheduler, _CUT_SIZES
    sched = Scheduler.__new__(Scheduler)
    sched.config = SimpleNamespace(max_model_len=10_000)
    tree = (list(range(40)), tuple([-1] * 4 + [j // 3 for j in range(36)]))
    sizes = set()
    for left in range(1, 60):
        req = SimpleNamespace(spec_draft=tree, num_pending=0, max_tokens=100,
                              num_output_tokens=100 - left, num_tokens=500)
        tokens, parents = sched._take_draft(req, 1, 10_000)
        assert len(tokens) == len(parents) <= left - 1
        assert all(p < j for j, p in enumerate(parents))
        sizes.add(len(tokens))
    assert sizes == {s for s in _CUT_SIZES if s < 40} | {40}


def test_draft_graphs_are_an_eagle_option(folder, tmp_path):
    from slipstream.engine.args import EngineArgs
    _, e = _heads(tmp_path, folder)
    for on in (True, False):
        llm = make_llm(folder, speculative_method="eagle", speculative_model=str(e),
                       speculative_draft_graphs=on)
        assert llm.engine.runner.speculator.proposer.expander.graphs_enabled is on
    assert EngineArgs(speculative_method="eagle",
                      speculative_draft_graphs=True).spec_config().draft_graphs
    assert not EngineArgs(speculative_method="eagle").spec_config().draft_graphs
    with pytest.raises(ValueError, match="speculative_draft_graphs"):
        EngineArgs(speculative_method="ngram", speculative_draft_graphs=True).spec_config()


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_speculation_over_a_quantized_kv_cache(folder, kv, tmp_path):
    """Draft tokens are stored as codes with their scales like any other; accepted
    ones move with their scales: greedy outputs equal plain decoding over the same
    quantized cache (each token's codes do not depend on what shares its step)."""
    base = make_llm(folder, kv_cache_dtype=kv)
    plain_kv = [o.outputs[0].token_ids for o in base.generate(_prompts(), GREEDY, use_tqdm=False)]
    for method in ("ngram", "eagle"):
        kw = dict(speculative_method=method, num_speculative_tokens=3, speculative_auto_off=False,
                  kv_cache_dtype=kv)
        if method == "eagle":
            _, e = _heads(tmp_path, folder)
            kw.update(speculative_model=str(e), speculative_tree="3,2,6")
        llm = make_llm(folder, **kw)
        outs = llm.generate(_prompts(), GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == plain_kv
        assert llm.engine.runner.speculator.stats.rounds > 0
        assert_no_leak(llm)


def test_kivi_refuses_speculation(folder):
    with pytest.raises(ValueError, match="not KIVI"):
        make_llm(folder, kv_cache_dtype="kivi4", speculative_method="ngram")

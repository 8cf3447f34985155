"""Speculation switched off with no probes ("quiet": spec/governor.py) at a large
batch costs a step nothing beyond plain decoding: no target states are kept
(those kept before are dropped) and the forward returns no feature taps. When
the batch shrinks speculation resumes from states kept after the gap, aligned
with the request's tokens, and greedy outputs equal plain decoding throughout."""
import pytest
import torch

from slipstream import SamplingParams
from tests.engine.conftest import assert_no_leak, make_llm, random_eagle_head, random_prompts

QUIET_FROM = 4      # the stand-in rule: quiet at batch >= 4, k drafts below


@pytest.fixture(scope="module")
def folder(tiny_folder):
    return tiny_folder("llama")[0]


@pytest.fixture(scope="module")
def plain(folder):
    prompts, params = _requests()
    return [o.outputs[0].token_ids for o in make_llm(folder).generate(prompts, params,
                                                                     use_tqdm=False)]


def _rule(gov):
    """The governor's answer by batch size alone (the measured rule's answer
    depends on timings): quiet from QUIET_FROM requests, else full drafts."""
    def num_tokens(batch):
        gov.request_limit = None
        gov.quiet = batch >= QUIET_FROM
        gov.last_k = 0 if gov.quiet else gov.k
        return gov.last_k
    return num_tokens


def _requests():
    # Two long requests speculate alone, four join (quiet), three finish early
    # (the batch shrinks to three: speculation resumes).
    prompts = random_prompts(6, 250, 5, 20, seed=4)
    lens = [24, 24, 4, 6, 8, 24]
    return prompts, [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lens]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("method", ["eagle", "ngram"])
def test_quiet_steps_keep_nothing_and_speculation_resumes_exactly(folder, plain, method, overlap,
                                                                  tmp_path):
    prompts, params = _requests()
    kw = dict(speculative_method=method, num_speculative_tokens=3, async_scheduling=overlap)
    if method == "eagle":    # an EAGLE-3 head: the forward taps layers 0 and 1
        kw.update(speculative_model=str(random_eagle_head(folder, tmp_path / "e3.safetensors",
                                                          "0,1")),
                  speculative_tree="2,2,4")
    llm = make_llm(folder, **kw)
    engine, runner = llm.engine, llm.engine.runner
    spec = runner.speculator
    spec.governor.num_tokens = _rule(spec.governor)
    h = runner.model.config.hidden_size
    states: dict[tuple[str, int], torch.Tensor] = {}   # (request, position) -> final state
    seen = []      # per step: (quiet, verifies drafts, forward width, states kept after)
    keep = spec.keep_hidden

    def keep_hidden(plan, hidden):
        loc = 0
        for rid, s, q in zip(plan.req_ids, plan.starts, plan.query_lens):
            n = 1 if rid in spec._step_trees else int(q)    # draft rows sit at no position
            for j in range(n):
                states[(rid, int(s) + j)] = hidden[loc + j, :h].clone()
            loc += int(q)
        keep(plan, hidden)
        seen.append((spec.governor.quiet, bool(spec._step_trees), hidden.shape[-1],
                     sum(x.shape[0] for parts in spec.hidden.values() for x in parts)))
    spec.keep_hidden = keep_hidden
    checked = []
    propose = spec.proposer.propose

    def checked_propose(reqs):
        # The states handed over end at the root and match the target's at their positions.
        for r in reqs:
            m = r.hidden.shape[0]
            for j in range(m):
                ref = states.get((r.request_id, len(r.token_ids) - 1 - m + j))
                if ref is not None:
                    torch.testing.assert_close(r.hidden[j, :h], ref, rtol=0, atol=1e-5)
                    checked.append(r.request_id)
        return propose(reqs)
    if spec.proposer.needs_hidden:
        spec.proposer.propose = checked_propose

    for i in (0, 1):
        engine.add_request(prompts[i], params[i], request_id=str(i))
    for _ in range(6):
        engine.step()
    rounds_alone = spec.stats.rounds
    for i in range(2, 6):
        engine.add_request(prompts[i], params[i], request_id=str(i))
    tokens = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] = out.outputs[0].token_ids
    assert [tokens[str(i)] for i in range(6)] == plain
    assert_no_leak(llm)

    quiet = [s for s in seen if s[0] and not s[1]]
    assert len(quiet) >= 4 and rounds_alone > 0
    last_quiet = max(i for i, s in enumerate(seen) if s[0])
    assert any(s[1] for s in seen[last_quiet:]), "speculation resumed once the batch shrank"
    assert all(kept == 0 for _, _, _, kept in quiet)                 # nothing kept while quiet
    taps = len(runner.model.model.feature_taps)
    assert all(width == h for _, _, width, _ in quiet)               # no feature taps
    if method == "eagle":
        assert taps == 2
        assert all(width == 3 * h for q, t, width, _ in seen if not q or t)
        assert checked and any(kept for q, _, _, kept in seen[last_quiet + 1:])

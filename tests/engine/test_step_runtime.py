"""The step runtime: persistent input batch, overlapped scheduling, incremental
penalties, plain step data. Outputs must not depend on any of it."""
import pickle

import numpy as np
import pytest
import torch

from slipstream import SamplingParams
from slipstream.layers.sampler import SamplingBatch
from tests.engine.conftest import assert_no_leak, make_llm, random_prompts

# Every sampling feature at once, across requests of one batch.
MIXED = [
    SamplingParams(max_tokens=10, temperature=0, logprobs=2),
    SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=11),
    SamplingParams(max_tokens=9, temperature=1.0, top_k=5, min_p=0.05, seed=12, logprobs=0),
    SamplingParams(max_tokens=11, temperature=0.7, repetition_penalty=1.3, frequency_penalty=0.4,
                   presence_penalty=0.2, seed=13),
    SamplingParams(max_tokens=8, temperature=0, min_tokens=6, ignore_eos=False),
    SamplingParams(max_tokens=10, temperature=0.9, seed=14, n=2, prompt_logprobs=1),
    SamplingParams(max_tokens=7, temperature=0, stop_token_ids=[5, 6, 7, 8, 9, 10]),
]


def _run(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [[(c.token_ids, c.finish_reason, c.text,
              [sorted((t, round(lp.logprob, 4)) for t, lp in d.items()) for d in c.logprobs or []])
             for c in o.outputs] + [o.prompt_logprobs is not None and len(o.prompt_logprobs)]
            for o in outs]


@pytest.fixture(scope="module")
def prompts():
    ps = random_prompts(len(MIXED), 265, 5, 40, seed=5)
    # Two share a prefix of three blocks, so the second admits with prefix hits.
    ps[3] = {"prompt_token_ids": ps[1]["prompt_token_ids"][:12] + [3, 4, 5]}
    return ps


def test_overlap_on_and_off_give_identical_outputs(tiny_folder, prompts):
    folder, _ = tiny_folder("llama")
    sync = make_llm(folder, async_scheduling=False)
    overlap = make_llm(folder, async_scheduling=True)
    assert not sync.engine.async_scheduling and overlap.engine.async_scheduling
    expect = _run(sync, prompts, MIXED)
    assert _run(overlap, prompts, MIXED) == expect
    # Again with a pool so small that requests are preempted and recomputed,
    # and a budget that chunks prompts and mixes them with decodes.
    tight = dict(max_model_len=64, num_kv_blocks=16, max_num_batched_tokens=16)
    for overlapped in (True, False):
        small = make_llm(folder, async_scheduling=overlapped, **tight)
        assert _run(small, prompts, MIXED) == expect
        outs = small.generate(prompts, MIXED, use_tqdm=False)
        assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert_no_leak(overlap)
    assert_no_leak(small)


def test_requests_joining_and_leaving_keep_their_outputs(tiny_folder, prompts):
    """Requests added while others run (the persistent batch reuses rows of
    finished ones) produce what they produce alone."""
    folder, _ = tiny_folder("llama")
    llm = make_llm(folder, async_scheduling=True)
    alone = [_run(llm, [p], [sp])[0] for p, sp in zip(prompts, MIXED)]
    engine = llm.engine
    done = {}
    pending = list(range(len(prompts)))
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 2 == 0:   # one new request every other step
            i = pending.pop(0)
            engine.add_request(prompts[i], MIXED[i], request_id=str(i))
        for out in engine.step():
            if out.finished:
                done[int(out.request_id)] = out
        step += 1
    for i, expect in enumerate(alone):
        o = done[i]
        got = [(c.token_ids, c.finish_reason, c.text,
                [sorted((t, round(lp.logprob, 4)) for t, lp in d.items()) for d in c.logprobs or []])
               for c in o.outputs] + [o.prompt_logprobs is not None and len(o.prompt_logprobs)]
        assert got == expect, i
    assert_no_leak(llm)


def test_incremental_penalty_counts_equal_a_full_recount(tiny_folder):
    folder, _ = tiny_folder("llama")
    llm = make_llm(folder, async_scheduling=False)
    engine = llm.engine
    params = SamplingParams(max_tokens=30, temperature=1.0, seed=3, repetition_penalty=1.2,
                            frequency_penalty=0.5, presence_penalty=0.5, ignore_eos=True)
    for i, p in enumerate(random_prompts(3, 265, 4, 20, seed=9)):
        engine.add_request(p, params, request_id=str(i))
    for _ in range(12):
        engine.step()
    runner = engine.runner
    reqs = [engine.scheduler.requests[str(i)] for i in range(3)]
    rows = np.array([runner.input_batch.row_of[r.request_id] for r in reqs])
    got = runner.sampling.build(rows).penalties
    ref = SamplingBatch.build([r.params for r in reqs], [r.prompt_token_ids for r in reqs],
                              [r.output_token_ids for r in reqs], [None] * 3, 265, "cpu").penalties
    assert all(r.num_output_tokens == 12 for r in reqs)
    assert torch.equal(got.output_counts, ref.output_counts)
    assert torch.equal(got.prompt_mask, ref.prompt_mask)
    for rid in list(engine.scheduler.requests):
        engine.abort_request(rid)


def test_step_data_is_plain_and_serializable(tiny_folder):
    folder, _ = tiny_folder("llama")
    llm = make_llm(folder)
    engine = llm.engine
    engine.add_request({"prompt_token_ids": [5, 6, 7, 8, 9]}, SamplingParams(max_tokens=3))
    sched = engine.scheduler.schedule()
    back = pickle.loads(pickle.dumps(sched))
    assert back == sched and back.new_requests[0].prompt_token_ids == [5, 6, 7, 8, 9]
    engine.runner.resolve(engine.runner.execute(sched))
    engine.abort_request("0")


def test_min_tokens_holds_back_stop_strings_and_eos(tiny_folder):
    folder, _ = tiny_folder("llama")
    llm = make_llm(folder)
    prompt = random_prompts(1, 265, 8, 8, seed=4)
    free = llm.generate(prompt, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    # A stop string made of the text of the 2nd token would end the request at once.
    stop = llm.get_tokenizer().decode(free.token_ids[1:2])
    assert stop.strip()
    out = llm.generate(prompt, SamplingParams(max_tokens=20, temperature=0, stop=[stop],
                                              min_tokens=15, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= 15
    # min_tokens masks every EOS id the engine stops on (config's and tokenizer's) ...
    eos = llm.engine.eos_token_ids
    masked = llm.generate(prompt, SamplingParams(max_tokens=6, temperature=0, min_tokens=6),
                          use_tqdm=False)[0].outputs[0]
    assert len(masked.token_ids) == 6 and not set(masked.token_ids) & set(eos)
    # ... but not for ignore_eos rows, where EOS is an ordinary token.
    runner = llm.engine.runner
    llm.engine.add_request(prompt[0], SamplingParams(max_tokens=4, min_tokens=3, ignore_eos=True),
                           request_id="x")
    llm.engine.step()
    row = runner.input_batch.row_of["x"]
    assert runner.sampling.min_token_ids[row] == ()
    llm.engine.abort_request("x")


@pytest.mark.parametrize("overlapped", [False, True])
def test_rows_of_finished_requests_are_reused(tiny_folder, overlapped):
    """Full batches one after another: the runner drops every finished request."""
    folder, _ = tiny_folder("llama")
    llm = make_llm(folder, max_num_seqs=4, async_scheduling=overlapped)
    for seed in range(3):
        outs = llm.generate(random_prompts(4, 265, 3, 9, seed=seed),
                            SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 3 for o in outs)
    assert llm.engine.runner.input_batch.num_reqs <= 4


def test_logit_bias_steers_tokens_in_the_persistent_batch(tiny_folder):
    folder, _ = tiny_folder("llama")
    llm = make_llm(folder)
    prompts = random_prompts(2, 265, 5, 9, seed=6)
    biased = SamplingParams(max_tokens=4, temperature=0, logit_bias={42: 100.0}, ignore_eos=True)
    plain = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, [biased, plain], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == [42] * 4
    assert outs[1].outputs[0].token_ids == llm.generate(prompts[1:], plain, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: 101.0})


def test_a_sampling_batch_is_reused_only_while_it_holds(tiny_folder):
    """`SamplingState.build` hands back the last batch while the same rows sample with
    nothing added or removed; a new request, a finished one, penalty counts or a
    min_tokens mask (which change with every step) build it again, equal to a fresh
    build."""
    folder, _ = tiny_folder("llama")
    llm = make_llm(folder, async_scheduling=False)
    engine, state = llm.engine, llm.engine.runner.sampling
    plain = SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)
    prompts = random_prompts(3, 265, 4, 20, seed=10)
    for i in range(2):
        engine.add_request(prompts[i], plain, request_id=str(i))
    engine.step()
    rows = np.array([engine.runner.input_batch.row_of[str(i)] for i in range(2)])
    first = state.build(rows)
    assert state.build(rows) is first
    engine.step()
    assert state.build(rows) is first                   # decode steps: still the same
    engine.add_request(prompts[2], SamplingParams(max_tokens=5, temperature=0.5, top_k=3),
                       request_id="2")
    engine.step()
    again = state.build(rows)
    assert again is not first                            # a request arrived: built again
    fields = ("temperature", "top_p", "top_k", "min_p")
    for f in fields:
        a, b = getattr(again, f), getattr(first, f)
        assert (a is None and b is None) or torch.equal(a, b), f
    assert state.build(rows[::-1]) is not again          # other rows
    for p in (SamplingParams(max_tokens=30, temperature=0.8, repetition_penalty=1.2, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0.8, min_tokens=20, ignore_eos=True)):
        engine.add_request(prompts[0], p, request_id=f"x{p.min_tokens}")
        engine.step()
        row = np.array([engine.runner.input_batch.row_of[f"x{p.min_tokens}"]])
        assert state.build(row) is not state.build(row)  # step-dependent: never kept
    for rid in list(engine.scheduler.requests):
        engine.abort_request(rid)

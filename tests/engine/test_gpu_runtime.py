"""The GPU step runtime (CUDA only; run on the device with the benchmarks):
a step launches with no host-device sync, and CUDA graphs and overlapped
scheduling change no output."""
import pytest
import torch

from slipstream import SamplingParams
from tests.engine.conftest import cuda_llm as _llm
from tests.engine.conftest import random_eagle_head, random_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

EVERYTHING = [
    SamplingParams(max_tokens=24, temperature=0, logprobs=2, ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=1, ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=1.0, top_k=5, min_p=0.05, seed=2, logprobs=0,
                   ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=0.7, repetition_penalty=1.3, frequency_penalty=0.4,
                   presence_penalty=0.2, seed=3, ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=0.9, min_tokens=20, stop_token_ids=[5, 6]),
    SamplingParams(max_tokens=24, temperature=0.6),
]


def _launch_step(engine, sched=None, check_syncs: bool = True) -> None:
    """Launch one step (`sched`, or the scheduler's next; everything the step does
    before its one wait) under `torch.cuda.set_sync_debug_mode("error")` when
    check_syncs; then collect the step before it, as the engine's overlapped loop does."""
    sched = engine.scheduler.schedule() if sched is None else sched
    if check_syncs:
        torch.cuda.set_sync_debug_mode("error")
    try:
        handle = engine.runner.execute(sched)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    engine._inflight, previous = handle, engine._inflight
    if previous is not None:
        engine._collect(previous)


def test_a_step_with_every_sampling_parameter_launches_without_a_sync(tiny_folder):
    folder, _ = tiny_folder("llama")
    llm = _llm(folder, dtype="bfloat16")
    engine = llm.engine
    prompts = random_prompts(len(EVERYTHING), 265, 30, 60, seed=3)
    for i, (p, sp) in enumerate(zip(prompts, EVERYTHING)):
        engine.add_request(p, sp, request_id=str(i))
    runner = engine.runner
    for _ in range(4):      # prompts, first decodes: kernels compile, the graph is captured
        engine.step()
    launched = 0
    for _ in range(6):
        _launch_step(engine)
        launched += 1
    assert launched == 6 and runner.graphs is not None and runner.graphs.graphs
    for rid in list(engine.scheduler.requests):
        engine.abort_request(rid)


def _outputs(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [max(d.values(), key=lambda x: x.logprob).logprob
                                      for d in o.outputs[0].logprobs or []]) for o in outs]


@pytest.mark.parametrize("kw", [dict(enforce_eager=True), dict(async_scheduling=False),
                                dict(enforce_eager=True, async_scheduling=False)])
def test_graphs_and_overlap_change_no_output(tiny_folder, kw):
    folder, _ = tiny_folder("llama")
    prompts = random_prompts(13, 265, 5, 90, seed=4)   # 13 requests: padded to bucket 16
    params = [SamplingParams(max_tokens=20, temperature=0, logprobs=1, ignore_eos=True)] * 6 + \
             [SamplingParams(max_tokens=20, temperature=0.8, seed=i, ignore_eos=True) for i in range(7)]
    base = _outputs(_llm(folder), prompts, params)
    other = _outputs(_llm(folder, **kw), prompts, params)
    assert [t for t, _ in other] == [t for t, _ in base]
    for (_, a), (_, b) in zip(base, other):
        assert a == pytest.approx(b, abs=1e-4)


def test_piecewise_graphs_change_no_output_and_replay_without_a_sync(tiny_folder, monkeypatch):
    folder, _ = tiny_folder("llama")
    prompts = random_prompts(10, 265, 20, 90, seed=6)   # chunks of 64 tokens beside decodes
    params = [SamplingParams(max_tokens=16, temperature=0, logprobs=1, ignore_eos=True)] * 5 + \
             [SamplingParams(max_tokens=16, temperature=0.8, seed=i, ignore_eos=True) for i in range(5)]
    monkeypatch.setenv("SLIPSTREAM_PIECEWISE_GRAPHS", "0")
    base = _outputs(_llm(folder, max_num_batched_tokens=64), prompts, params)
    monkeypatch.setenv("SLIPSTREAM_PIECEWISE_GRAPHS", "1")
    llm = _llm(folder, max_num_batched_tokens=64)
    other = _outputs(llm, prompts, params)
    pw = llm.engine.runner.piecewise
    assert pw.enabled and len(pw.pieces) >= 2
    assert [t for t, _ in other] == [t for t, _ in base]
    for (_, a), (_, b) in zip(base, other):
        assert a == pytest.approx(b, abs=1e-4)
    # A step of a captured bucket launches without a sync.
    engine = llm.engine
    one = SamplingParams(max_tokens=1, temperature=0.7, seed=5)
    for seed in (11, 12):
        engine.add_request(random_prompts(1, 265, 40, 40, seed=seed)[0], one, request_id=str(seed))
        sched = engine.scheduler.schedule()
        assert pw.bucket_for(sum(sched.num_scheduled_tokens.values())) in pw.pieces or seed == 11
        _launch_step(engine, sched, check_syncs=seed == 12)
        while engine.has_unfinished_requests():
            engine.step()


@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_piecewise_graphs_under_speculation(tiny_folder, monkeypatch, tmp_path, method):
    """Speculation keeps the captured pieces for steps without draft trees (an EAGLE-3
    head's feature taps included): greedy tokens equal the plain engine's without pieces."""
    folder, _ = tiny_folder("llama")
    kw = dict(speculative_method="ngram", num_speculative_tokens=3, speculative_auto_off=False)
    if method == "eagle3":
        random_eagle_head(folder, tmp_path / "e3.safetensors", "0,1")
        kw.update(speculative_method="eagle", speculative_model=str(tmp_path / "e3.safetensors"),
                  speculative_tree="2,2,4")
    rep = [{"prompt_token_ids": [5, 6, 7, 8, 9] * 6}, {"prompt_token_ids": [11, 12, 13] * 9}]
    prompts = rep + random_prompts(6, 265, 20, 90, seed=8)
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    monkeypatch.setenv("SLIPSTREAM_PIECEWISE_GRAPHS", "0")
    base = [o.outputs[0].token_ids for o in _llm(folder, max_num_batched_tokens=64).generate(
        prompts, greedy, use_tqdm=False)]
    monkeypatch.setenv("SLIPSTREAM_PIECEWISE_GRAPHS", "1")
    llm = _llm(folder, max_num_batched_tokens=64, **kw)
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    pw = llm.engine.runner.piecewise
    assert pw is not None and pw.enabled and pw.pieces
    assert llm.engine.runner.speculator.stats.rounds > 0
    assert outs == base


def test_speculation_with_logprobs_on_cuda(tiny_folder):
    """A request asking for log-probabilities speculates on the GPU: tokens and
    log-probabilities equal plain decoding's, and a round still launches without
    a synchronizing call (its one wait is an event) unless it captures the CUDA
    graph of a new tree size (a capture synchronizes, once)."""
    from slipstream.spec.bench_profile import count_syncs
    folder, _ = tiny_folder("llama")
    prompt = {"prompt_token_ids": [5, 6, 7, 8, 9] * 4}
    params = SamplingParams(max_tokens=20, temperature=0, logprobs=2, ignore_eos=True)
    plain = _llm(folder).generate([prompt], params, use_tqdm=False)[0].outputs[0]
    llm = _llm(folder, speculative_method="ngram", num_speculative_tokens=3,
               speculative_auto_off=False)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert llm.engine.runner.speculator.stats.accepted > 0
    assert out.token_ids == plain.token_ids
    for x, y in zip(out.logprobs, plain.logprobs):
        assert list(x) == list(y)
        for t in x:
            assert x[t].rank == y[t].rank and x[t].logprob == pytest.approx(y[t].logprob, abs=1e-4)
    r = count_syncs(llm, prompt, SamplingParams(max_tokens=60, temperature=0, logprobs=2,
                                                ignore_eos=True), warmup_steps=2, rounds=4)
    assert r["syncs_per_round"] and min(r["syncs_per_round"]) == 0, r
    assert all(place.startswith("cuda_graph.py:") for place in r["sync_places"]), r
    assert r["error_mode_round"] in (None, "passed"), r


def test_kivi_decodes_on_the_triton_backend_as_on_the_torch_backend(tiny_folder):
    """A KIVI cache on the GPU: the Triton backend's decode kernel against the torch
    backend's path, fp32 (full-precision dots), blocks sealed while decoding; no graphs."""
    folder, _ = tiny_folder("llama")
    prompts = random_prompts(3, 265, 20, 40, seed=5)
    p = SamplingParams(max_tokens=48, temperature=0, logprobs=1, ignore_eos=True)
    got = {}
    for backend in ("torch", "triton"):
        llm = _llm(folder, dtype="float32", kv_cache_dtype="kivi4", block_size=16,
                   attention_backend=backend)
        assert llm.engine.runner.graphs is None
        got[backend] = _outputs(llm, prompts, p)
        # the window pool was allocated at its most (and set aside by the planner): no growth
        from slipstream.runner.memory import kivi_window_bytes
        cfg = llm.engine.config
        slots = kivi_window_bytes(cfg.cache, cfg.model_config, cfg.scheduler, torch.float32)[0]
        assert {layer.kivi.win_k.shape[0] for layer in llm.engine.runner.model.attention_layers()} == {slots}
        del llm
    for (ta, la), (tb, lb) in zip(got["torch"], got["triton"]):
        assert ta == tb
        assert la == pytest.approx(lb, abs=1e-4)


def test_a_kivi_decode_step_launches_without_a_sync(tiny_folder):
    """Over a KIVI cache (eager steps) the window bookkeeping runs on the host from the
    step's host copies, and its index tensors go to the device through pinned memory:
    a decode step queues its work without waiting for the GPU."""
    folder, _ = tiny_folder("llama")
    llm = _llm(folder, dtype="bfloat16", kv_cache_dtype="kivi4", block_size=16,
               attention_backend="triton")
    engine = llm.engine
    for i, p in enumerate(random_prompts(2, 265, 40, 60, seed=6)):
        engine.add_request(p, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
                           request_id=str(i))
    for _ in range(3):      # prompts and first decodes: kernels compile
        engine.step()
    for _ in range(20):     # crosses block ends: new window slots and seals
        _launch_step(engine)
    for rid in list(engine.scheduler.requests):
        engine.abort_request(rid)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="the TMA GEMV needs an sm_90 GPU")
def test_batch_one_decode_through_the_tma_gemv(tiny_folder, monkeypatch):
    """bf16, one request, SLIPSTREAM_TMA_GEMV=1: decode steps take the TMA GEMVs with the
    norms and SiLU folded in (layers/decode_gemv.py), inside the captured graph and
    without a host sync; the tokens equal the cuBLAS path's (SLIPSTREAM_TMA_GEMV=0),
    log-probs within bf16 noise."""
    from slipstream.layers import decode_gemv
    monkeypatch.setenv("SLIPSTREAM_TMA_GEMV", "1")
    folder, _ = tiny_folder("llama")
    prompts = random_prompts(2, 265, 20, 40, seed=7)
    params = SamplingParams(max_tokens=16, temperature=0, logprobs=1, ignore_eos=True)
    calls = []
    gemv = decode_gemv.gemv
    monkeypatch.setattr(decode_gemv, "gemv", lambda *a, **kw: calls.append(kw) or gemv(*a, **kw))
    on = [_outputs(_llm(folder, dtype="bfloat16"), [p], params)[0] for p in prompts]
    kinds = {tuple(sorted(kw)) for kw in calls}
    assert ("silu_mul",) in kinds and ("eps", "norm_weight", "residual", "residual_out") in kinds
    llm = _llm(folder, dtype="bfloat16")
    llm.engine.add_request(prompts[0], params, request_id="a")
    for _ in range(3):
        llm.engine.step()
    for _ in range(3):
        _launch_step(llm.engine)       # graph replays of batch-1 decode steps, no sync
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.graphs
    llm.engine.abort_request("a")
    monkeypatch.setenv("SLIPSTREAM_TMA_GEMV", "0")
    n = len(calls)
    off = [_outputs(_llm(folder, dtype="bfloat16"), [p], params)[0] for p in prompts]
    assert len(calls) == n
    for (t_on, lp_on), (t_off, lp_off) in zip(on, off):
        assert t_on == t_off
        assert lp_on == pytest.approx(lp_off, abs=5e-2)


def test_speculation_with_penalties_and_logit_bias_on_cuda(tiny_folder):
    """Requests with penalties and logit bias speculate on the GPU: greedy tokens
    equal plain decoding's (each verification row judged by the logits plain
    decoding samples from after that row's path), and a round launches without a
    synchronizing call unless it captures a new tree size's graph."""
    from slipstream.spec.bench_profile import count_syncs
    folder, _ = tiny_folder("llama")
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9] * 4}, {"prompt_token_ids": [11, 12, 13] * 6},
               {"prompt_token_ids": [3, 4, 5, 6] * 5}]
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, repetition_penalty=1.3,
                             frequency_penalty=0.3, presence_penalty=0.2),
              SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                             logit_bias={7: 2.5, 101: -50.0}),
              SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, frequency_penalty=0.5,
                             logit_bias={9: 1.0})]
    plain = [o.outputs[0].token_ids for o in _llm(folder).generate(prompts, params, use_tqdm=False)]
    llm = _llm(folder, speculative_method="ngram", num_speculative_tokens=3,
               speculative_auto_off=False)
    outs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.engine.runner.speculator.stats
    assert stats.rounds > 0 and stats.drafted > 0
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert sum(o.extra["num_draft_tokens"] for o in outs) == stats.drafted
    r = count_syncs(llm, prompts[1], SamplingParams(
        max_tokens=60, temperature=0, ignore_eos=True, logit_bias={7: 2.5, 101: -50.0},
        presence_penalty=0.1), warmup_steps=2, rounds=4)
    assert r["syncs_per_round"] and min(r["syncs_per_round"]) == 0, r
    assert all(place.startswith("cuda_graph.py:") for place in r["sync_places"]), r
    assert r["error_mode_round"] in (None, "passed"), r


def test_graphs_captured_before_serving_serve_every_step(tiny_folder, tmp_path):
    """capture_graphs captures every prompt-token bucket's pieces and every decode
    batch size's graphs (each context class) up front: a later run of mixed lengths
    (short contexts and ones past 512 tokens) and batch sizes captures nothing more,
    and its outputs equal an engine's that captured as it went."""
    import json
    import shutil
    from slipstream.engine.warmup import capture_graphs
    folder = tmp_path / "long"      # the tiny model with a context past the short class
    shutil.copytree(tiny_folder("llama")[0], folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 2048}))
    kw = dict(max_num_batched_tokens=64, max_num_seqs=16, num_kv_blocks=256, max_model_len=1200)
    prompts = random_prompts(9, 265, 3, 40, seed=9) + random_prompts(2, 265, 560, 700, seed=10)
    p = SamplingParams(max_tokens=12, temperature=0, logprobs=1, ignore_eos=True)
    lazy = _outputs(_llm(folder, **kw), prompts, p)
    llm = _llm(folder, **kw)
    r = capture_graphs(llm.engine)
    runner = llm.engine.runner
    assert r["token_buckets"] == len([t for t in runner.piecewise.buckets if t <= 64]) > 0
    assert sorted(runner.piecewise.pieces) == [t for t in runner.piecewise.buckets if t <= 64]
    assert {k[0] for k in runner.graphs.graphs} == set(runner.graphs.buckets) and r["decode_buckets"]
    assert {k[2] for k in runner.graphs.graphs} == {True, False}   # short and longer classes
    assert llm.engine.kv.pool.num_cached_blocks == 0 and not llm.engine.has_unfinished_requests()
    before = (set(runner.graphs.graphs), set(runner.piecewise.pieces))
    assert _outputs(llm, prompts, p) == lazy
    assert (set(runner.graphs.graphs), set(runner.piecewise.pieces)) == before

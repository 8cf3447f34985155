"""Engine behaviour on a tiny random Llama: caching, preemption and batching
never change greedy outputs; nothing leaks; bad input fails clearly."""
import pytest

from slipstream import SamplingParams
from slipstream.errors import ModelLoadError
from tests.engine.conftest import assert_no_leak, make_llm, random_prompts

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_batch_of_32_mixed_lengths_matches_each_alone(llama_llm):
    prompts = random_prompts(32, 265, 1, 60, seed=2)
    batched = tokens(llama_llm.generate(prompts, GREEDY, use_tqdm=False))
    alone = [tokens(llama_llm.generate([p], GREEDY, use_tqdm=False))[0] for p in prompts]
    assert batched == alone
    assert all(len(t) == 12 for t in batched)
    assert_no_leak(llama_llm)


def test_prefix_cache_hit_gives_cold_run_tokens(tiny_folder):
    folder, _ = tiny_folder("llama")
    cold = make_llm(folder, enable_prefix_caching=False)
    warm = make_llm(folder)
    shared = random_prompts(1, 265, 40, 40, seed=3)[0]["prompt_token_ids"]
    prompts = [{"prompt_token_ids": shared + tail} for tail in ([7, 8, 9], [10], [11, 12, 13, 14, 15])]
    expect = tokens(cold.generate(prompts, GREEDY, use_tqdm=False))
    warm.generate(prompts[:1], GREEDY, use_tqdm=False)  # fills the cache
    pool = warm.engine.kv.pool
    assert pool.num_cached_blocks >= 10
    outs = warm.generate(prompts, GREEDY, use_tqdm=False)
    assert tokens(outs) == expect
    # The shared 40 tokens (10 blocks) were hits; the first prompt was cached
    # whole but for its last token, which is always recomputed.
    assert [o.num_cached_tokens for o in outs] == [40, 40, 40]
    assert all(o.num_cached_tokens == 0 for o in cold.generate(prompts, GREEDY, use_tqdm=False))

    # Reset: the same prompts compute whole again, with the same tokens.
    warm.engine.add_request(prompts[0], GREEDY)
    assert warm.reset_prefix_cache() is False          # a request is unfinished
    assert pool.num_cached_blocks >= 10
    while warm.engine.has_unfinished_requests():
        warm.engine.step()
    assert warm.reset_prefix_cache() is True
    assert pool.num_cached_blocks == 0
    outs = warm.generate(prompts, GREEDY, use_tqdm=False)
    assert tokens(outs) == expect
    assert [o.num_cached_tokens for o in outs] == [0, 40, 40]   # the first fills it again
    assert_no_leak(warm)
    assert_no_leak(warm)


def test_preemption_does_not_change_outputs(tiny_folder):
    folder, _ = tiny_folder("llama")
    roomy = make_llm(folder)
    # 40 blocks of 4 tokens: eight requests of ~30 tokens growing to ~50 cannot all fit.
    tight = make_llm(folder, num_kv_blocks=40, max_model_len=128)
    prompts = random_prompts(8, 265, 25, 35, seed=4)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    expect = tokens(roomy.generate(prompts, params, use_tqdm=False))
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert tokens(outs) == expect
    assert_no_leak(tight)


def test_seeded_sampling_reproducible_and_n_fans_out(llama_llm):
    prompts = random_prompts(3, 265, 5, 20, seed=5)
    p = SamplingParams(max_tokens=10, temperature=1.0, seed=7, n=3, ignore_eos=True)
    a = llama_llm.generate(prompts, p, use_tqdm=False)
    b = llama_llm.generate(prompts[::-1], p, use_tqdm=False)[::-1]  # other batch order
    for x, y in zip(a, b):
        assert [c.token_ids for c in x.outputs] == [c.token_ids for c in y.outputs]
        assert [c.index for c in x.outputs] == [0, 1, 2]
        assert len({tuple(c.token_ids) for c in x.outputs}) > 1  # children use seed + i
    assert_no_leak(llama_llm)


def test_the_largest_seed_fans_out_and_a_failed_call_leaves_nothing(llama_llm, monkeypatch):
    top = SamplingParams(max_tokens=4, temperature=1.0, seed=2 ** 64 - 1, n=2, ignore_eos=True)
    assert [top.child(i).seed for i in range(2)] == [2 ** 64 - 1, -(2 ** 63)]   # wrapped
    outs = llama_llm.generate(random_prompts(1, 265, 5, 10, seed=3), top, use_tqdm=False)
    assert len(outs[0].outputs) == 2
    # The second prompt's request fails: the first one's does not stay behind.
    real, calls = llama_llm.engine.add_request, []

    def second_fails(prompt, params, *a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise ValueError("refused")
        return real(prompt, params, *a, **kw)
    monkeypatch.setattr(llama_llm.engine, "add_request", second_fails)
    with pytest.raises(ValueError, match="refused"):
        llama_llm.generate(random_prompts(2, 265, 5, 10, seed=4), SamplingParams(max_tokens=4),
                           use_tqdm=False)
    assert not llama_llm.engine.has_unfinished_requests()
    assert_no_leak(llama_llm)


def test_stop_token_ids_and_max_tokens(llama_llm):
    prompt = random_prompts(1, 265, 10, 10, seed=6)
    free = llama_llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0]
    stop_tok = free.token_ids[4]
    first = free.token_ids.index(stop_tok)
    out = llama_llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                    stop_token_ids=[stop_tok]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free.token_ids[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    assert free.finish_reason == "length"


def test_stop_string_truncates_text(llama_llm):
    prompt = random_prompts(1, 265, 10, 10, seed=8)
    free = llama_llm.generate(prompt, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0]
    text = free.text
    stop = text[5:8]
    assert len(stop) == 3 and stop.strip()
    cut = text.index(stop)
    out = llama_llm.generate(prompt, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop]),
                             use_tqdm=False)[0].outputs[0]
    assert out.text == text[:cut] and out.finish_reason == "stop" and out.stop_reason == stop
    kept = llama_llm.generate(prompt, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop],
                                                     include_stop_str_in_output=True),
                              use_tqdm=False)[0].outputs[0]
    assert kept.text == text[:cut + 3]


def test_abort_frees_blocks(llama_llm):
    engine = llama_llm.engine
    ids = [engine.add_request(p, SamplingParams(max_tokens=50, ignore_eos=True))
           for p in random_prompts(4, 265, 10, 30, seed=9)]
    for _ in range(3):
        engine.step()
    assert engine.kv.pool.num_free_blocks < engine.kv.pool.num_blocks
    for rid in ids:
        engine.abort_request(rid)
    assert_no_leak(llama_llm)


@pytest.mark.parametrize("prompt,params,match", [
    ("", SamplingParams(), "empty"),
    ({"prompt_token_ids": []}, SamplingParams(), "empty"),
    ({"prompt_token_ids": [5] * 256}, SamplingParams(), "maximum model length"),
    ({"prompt_token_ids": [5, 999]}, SamplingParams(), "prompt_token_ids"),
])
def test_bad_prompts_raise_value_error(llama_llm, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        llama_llm.generate([prompt], params, use_tqdm=False)
    assert_no_leak(llama_llm)


@pytest.mark.parametrize("kwargs,field", [({"ignore_eos": "yes"}, "ignore_eos"),
                                          ({"include_stop_str_in_output": 1}, "include_stop_str_in_output"),
                                          ({"max_tokens": -1}, "max_tokens"), ({"top_p": 0}, "top_p"),
                                          ({"temperature": -1}, "temperature"), ({"n": 0}, "n")])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_unknown_model_path_is_a_clear_error(tmp_path):
    from slipstream import LLM
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(str(tmp_path / "nope"))


def test_truncated_checkpoints_are_clear_errors(tiny_folder, tmp_path):
    import shutil
    from slipstream import LLM
    folder, _ = tiny_folder("llama")
    bad = tmp_path / "truncated"
    shutil.copytree(folder, bad)
    st = bad / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        LLM(str(bad), device="cpu")
    from slipstream.loader import default_model_path
    gguf_bytes = default_model_path().read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(gguf_bytes[: len(gguf_bytes) // 3])
    with pytest.raises(ModelLoadError, match="cut.gguf"):
        LLM(str(cut), device="cpu")


@pytest.mark.parametrize("device", ["tpu", "gpu", "cuda:x"])
def test_an_unknown_device_is_a_clear_error(tiny_folder, device):
    with pytest.raises(ValueError, match="device: expected auto, cpu, cuda or cuda:N"):
        make_llm(tiny_folder("llama")[0], device=device)


def test_gptq_asked_of_a_float_checkpoint_is_a_clear_error(tiny_folder):
    with pytest.raises(ValueError, match="reads GPTQ checkpoints; this model has no quantization_config"):
        make_llm(tiny_folder("llama")[0], quantization="gptq")


def test_gguf_named_runs_its_blocks_in_fp32_as_auto_does():
    import torch
    from slipstream.engine.args import EngineArgs
    from slipstream.kernels import cpu_library
    from slipstream.loader import open_model
    if cpu_library.load() is None:
        pytest.skip("the CPU kernels did not build here")
    files = open_model(None)
    for q in ("auto", "gguf"):
        cfg = EngineArgs(quantization=q, device="cpu").create_config(str(files.path), files.config)
        assert cfg.quantization == "gguf" and cfg.dtype == torch.float32


def test_chat_takes_text_content_parts(llama_llm):
    params = SamplingParams(max_tokens=4, temperature=0)
    parts = [{"role": "user", "content": [{"type": "text", "text": "hello "},
                                          {"type": "text", "text": "there"}]}]
    whole = [{"role": "user", "content": "hello there"}]
    if llama_llm.engine.tokenizer.chat_template is None:
        pytest.skip("the tiny model has no chat template")
    a = llama_llm.chat(parts, params, use_tqdm=False)[0].outputs[0].token_ids
    assert a == llama_llm.chat(whole, params, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="only text content parts"):
        llama_llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
                       params, use_tqdm=False)


def test_cpu_attention_of_fresh_prompts_does_not_depend_on_the_step(tiny_folder):
    """On the CPU kernels' path a fresh prompt's attention is the same alone or beside
    another prompt in one step (exact equality of the first layer's attention output;
    before, a batch went through the paged reference and a lone prompt through SDPA)."""
    import torch
    from slipstream.kernels import cpu_library
    if cpu_library.load() is None:
        pytest.skip("the CPU kernels did not build here")
    folder, _ = tiny_folder("llama")
    llm = make_llm(folder, enable_prefix_caching=False, attention_backend="torch")
    seen = []
    attn = llm.engine.runner.model.model.layers[0].self_attn.attn
    attn.register_forward_hook(lambda mod, inp, out: seen.append(out.detach().clone()))
    a, b = random_prompts(2, 265, 12, 12, seed=11)
    p = SamplingParams(max_tokens=1, temperature=0)
    llm.generate([a], p, use_tqdm=False)
    alone = seen[0]
    seen.clear()
    llm.generate([a, b], p, use_tqdm=False)
    assert torch.equal(seen[0][:len(a["prompt_token_ids"])], alone)


def test_capturing_graphs_ahead_is_skipped_without_graphs(llama_llm):
    """On the CPU (no CUDA graphs) capture_graphs says why it did nothing and runs
    nothing; the serve command's switch for it parses."""
    from slipstream.cli import build_parser
    from slipstream.engine.warmup import capture_graphs
    assert "no CUDA graphs" in capture_graphs(llama_llm.engine)["skipped"]
    assert not llama_llm.engine.has_unfinished_requests()
    args = build_parser("serve").parse_args(["serve", "--no-graph-warmup"])
    assert args.no_graph_warmup is True
    assert build_parser("serve").parse_args(["serve"]).no_graph_warmup is False


def test_token_ids_of_sampling_parameters_are_checked_against_the_vocabulary(llama_llm):
    """logit_bias and stop_token_ids outside the vocabulary are refused before
    anything runs (they were silently ignored)."""
    for params in (SamplingParams(logit_bias={10 ** 7: 1.0}), SamplingParams(stop_token_ids=[10 ** 7])):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            llama_llm.generate(["hello"], params, use_tqdm=False)
    assert not llama_llm.engine.has_unfinished_requests()


def test_an_empty_model_path_is_refused():
    from slipstream.loader import open_model
    with pytest.raises(ModelLoadError, match="the path is empty"):
        open_model("")


@pytest.mark.parametrize("params", [{"max_tokens": 3}, [{"max_tokens": 3}], "max_tokens=3", 3])
def test_sampling_params_of_another_type_are_a_type_error(llama_llm, params):
    """A dict (or anything else) in place of SamplingParams: a TypeError naming
    SamplingParams before anything runs (it was an AttributeError deep inside)."""
    with pytest.raises(TypeError, match="expected a SamplingParams or a list of them"):
        llama_llm.generate(["x"], params, use_tqdm=False)
    with pytest.raises(TypeError, match=r"SamplingParams\(\*\*options\)"):
        llama_llm.generate(["x"], {"max_tokens": 3}, use_tqdm=False)
    assert not llama_llm.engine.has_unfinished_requests()


def test_logprobs_are_capped_by_max_logprobs(llama_llm, tiny_folder):
    """As vLLM's max_logprobs (20): more is refused before anything runs, -1 (the
    whole vocabulary) counts as its size; LLM(max_logprobs=-1) lifts the cap."""
    for params, name in ((SamplingParams(logprobs=100000), "logprobs=100000"),
                         (SamplingParams(prompt_logprobs=21), "prompt_logprobs=21"),
                         (SamplingParams(logprobs=-1), "logprobs=-1 .the whole vocabulary")):
        with pytest.raises(ValueError, match=f"{name}.* exceeds max_logprobs=20"):
            llama_llm.generate(["hello"], params, use_tqdm=False)
    assert not llama_llm.engine.has_unfinished_requests()
    out = llama_llm.generate(["hello"], SamplingParams(max_tokens=1, logprobs=20), use_tqdm=False)
    assert len(out[0].outputs[0].logprobs[0]) >= 20
    vocab = llama_llm.engine.config.model_config.vocab_size
    free = make_llm(tiny_folder("llama")[0], max_logprobs=-1)
    out = free.generate(["hello"], SamplingParams(max_tokens=1, logprobs=-1), use_tqdm=False)
    assert len(out[0].outputs[0].logprobs[0]) == vocab
    with pytest.raises(ValueError, match="max_logprobs must be -1"):
        make_llm(tiny_folder("llama")[0], max_logprobs=-2)


def test_step_finished_only_returns_the_finished_outputs_whole(llama_llm):
    """`Engine.step(finished_only=True)` (what LLM.generate reads) returns only finished
    requests, each output equal to the last one the plain steps return for it (text,
    tokens, finish reason), sampled and stop-string requests included."""
    prompts = random_prompts(6, 265, 3, 30, seed=5)
    params = [SamplingParams(max_tokens=4 + 3 * i, temperature=0.8 * (i % 2), seed=i, ignore_eos=True)
              for i in range(6)]

    def run(finished_only):
        engine = llama_llm.engine
        ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        last, steps = {}, 0
        while engine.has_unfinished_requests():
            for out in engine.step(finished_only=finished_only):
                assert out.finished or not finished_only
                last[out.request_id] = out
            steps += 1
        return [last[i] for i in ids], steps

    def strip(o):   # what a request's answer is, its id and timings aside
        return [(c.text, c.token_ids, c.finish_reason) for c in o.outputs], o.prompt_token_ids
    every, _ = run(False)
    finished, _ = run(True)
    assert [strip(o) for o in finished] == [strip(o) for o in every]
    assert all(o.finished for o in finished)
    assert_no_leak(llama_llm)

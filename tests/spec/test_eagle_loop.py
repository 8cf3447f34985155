"""The EAGLE loop (every round on the device) emits exactly plain greedy
decoding's tokens, with the shipped head on the default model (acceptance
around one half, so rounds accept none, some and all of their drafts)."""
import pytest
import torch

from slipstream import LLM, SamplingParams
from slipstream.spec.eagle_loop import EagleLoop

TEXTS = ["Write a haiku about the sea.", "List five uses of a paper clip and say why each works."]


@pytest.fixture(scope="module")
def llm():
    return LLM(device="cpu", max_model_len=256, seed=0, kv_cache_memory=64 << 20,
               enable_prefix_caching=False)


def _prompt(llm, text):
    tok = llm.get_tokenizer()
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]),
                      add_special_tokens=False)


@pytest.mark.parametrize("shape", [(5, 4, 4, 16), (3, 2, 1, 3)])
def test_loop_is_token_identical_to_plain_greedy(llm, shape):
    d, k, b, n = shape
    loop = EagleLoop(llm, depth=d, topk=k, beam=b, max_nodes=n, max_len=256)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    for text in TEXTS:
        ids = _prompt(llm, text)
        ref = list(llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
                   .outputs[0].token_ids)
        assert loop.generate(ids, 32) == ref
    assert loop.emitted / loop.rounds > 1.2         # drafts were accepted
    free = loop.block_pool.num_free_blocks
    loop.generate(ids, 8)
    assert loop.block_pool.num_free_blocks == free  # blocks given back


def test_loop_with_an_eagle3_head_is_token_identical(llm, tmp_path):
    """A (random) head reading the target's layers 2, 15 and 27: the loop's
    prefill, rounds and catch-up feed it the target's taps."""
    from slipstream.spec.eagle_head import EagleHead
    from slipstream.spec.train import eagle_shape_for
    torch.manual_seed(0)
    model = llm.engine.runner.model
    EagleHead(eagle_shape_for(model.config, 128, (2, 15, 27))).save(tmp_path / "e3.safetensors")
    loop = EagleLoop(llm, tmp_path / "e3.safetensors", depth=3, topk=2, beam=2, max_nodes=6,
                     max_len=256)
    try:
        assert model.model.feature_taps == (2, 15, 27)
        ids = _prompt(llm, TEXTS[0])
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        ref = list(llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
                   .outputs[0].token_ids)
        assert loop.generate(ids, 12) == ref
    finally:
        model.set_feature_taps(())


def test_loop_checks_its_options(llm):
    with pytest.raises(ValueError, match="max_nodes"):
        EagleLoop(llm, max_nodes=64)
    with pytest.raises(ValueError, match="candidates"):
        EagleLoop(llm, depth=2, topk=2, beam=1, max_nodes=5)      # 2 + 1 x 2 candidates
    loop = EagleLoop(llm, depth=2, topk=2, beam=2, max_nodes=4, max_len=64)
    with pytest.raises(ValueError, match="max_len"):
        loop.generate(list(range(60)), 8)


def test_llm_generate_takes_the_loop_for_one_greedy_prompt(llm):
    """Same tokens, text, finish reason and stops as plain decoding; counters
    of the speculator count the loop's rounds; other requests take the engine."""
    spec = LLM(device="cpu", max_model_len=256, seed=0, kv_cache_memory=64 << 20,
               enable_prefix_caching=False, speculative_method="eagle",
               num_speculative_tokens=4, speculative_tree="4,4,12", speculative_device_loop=True)
    prompt = {"prompt_token_ids": _prompt(llm, TEXTS[0])}
    cases = [SamplingParams(temperature=0.0, max_tokens=40),
             SamplingParams(temperature=0.0, max_tokens=40, stop=[" the"]),
             SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[28]),
             SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)]
    for params in cases:
        want = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        got = spec.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == (
            want.token_ids, want.text, want.finish_reason, want.stop_reason)
    st = spec.engine.spec_stats
    assert st.rounds > 0 and st.tau > 1.2
    assert sum(lp.rounds for lp in spec.engine.loop_path().loops.values()) == st.rounds
    # Two prompts (or sampling) take the engine's speculative path.
    rounds = st.rounds
    spec.generate([prompt, prompt], cases[0], use_tqdm=False)
    spec.generate(prompt, SamplingParams(temperature=0.8, seed=1, max_tokens=8), use_tqdm=False)
    assert sum(lp.rounds for lp in spec.engine.loop_path().loops.values()) == rounds


def test_compiled_loop_through_llm_generate_is_token_identical(llm):
    """speculative_compile: the loop's expansion and round parts through
    torch.compile give plain greedy decoding's tokens, with no compiled part
    falling back to its plain function."""
    with pytest.raises(ValueError, match="speculative_compile"):
        LLM(device="cpu", max_model_len=256, speculative_method="eagle", speculative_compile=True)
    spec = LLM(device="cpu", max_model_len=256, seed=0, kv_cache_memory=64 << 20,
               enable_prefix_caching=False, speculative_method="eagle",
               num_speculative_tokens=3, speculative_tree="2,2,4", speculative_device_loop=True,
               speculative_compile=True)
    prompt = {"prompt_token_ids": _prompt(llm, TEXTS[1])}
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    got = spec.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == want
    loop = spec.engine.loop_path().loop
    assert loop.rounds > 0 and loop.compile_error is None
    assert loop._levels is not loop.expander.levels          # the compiled wrapper ran


def test_first_by_rank_is_the_stable_sort_prefix():
    from slipstream.spec.loop_parts import first_by_rank
    gen = torch.Generator().manual_seed(0)
    for c, n in ((328, 60), (6, 6), (40, 1), (64, 63)):
        key = torch.randint(0, 12, (c,), generator=gen).double() / 4 - 3     # many ties
        want = key.sort(descending=True, stable=True).indices[:n]
        assert torch.equal(first_by_rank(key, n), want)


def test_padded_prefill_body_matches_the_eager_prefill(llm):
    """What the prefill graph runs (a GPU captures it): the prompt padded to its
    length class gives the same first token, head context and next tokens.
    (A prompt of one query block of torch's CPU flash attention, 32 rows: in a
    later block a row's sums depend on the block's length, so padding changes
    their last bits, which the int8 activations of the next products can turn
    into a different near-tie token.)"""
    loop = EagleLoop(llm, depth=3, topk=4, beam=4, max_nodes=12, max_len=256)
    ids = _prompt(llm, TEXTS[1])[:32]
    ref = loop.generate(ids, 16)
    blocks = loop.block_pool.allocate(loop.nblocks)
    try:
        loop._use_blocks(torch.tensor([b.block_id for b in blocks], dtype=torch.int32))
        with torch.inference_mode():
            size = 64
            buf = dict(ids=torch.tensor(ids + [0] * (size - len(ids))),
                       last=torch.tensor(len(ids) - 1), pos=torch.arange(size),
                       loc=torch.tensor([0, size], dtype=torch.int32),
                       lens=torch.tensor([size], dtype=torch.int32),
                       ctx=torch.zeros(1, dtype=torch.int32), rows=torch.arange(loop.hvalid.shape[0]))
            loop._prefill_body(buf, size)
            assert int(loop.n_ctx) == int(loop.hptr) == int(loop.hvalid.sum()) == len(ids)
            assert int(loop.root) == ref[0]
            out = [int(loop.root)]
            loop.rix.zero_()
            for _ in range(8):
                loop.round()
            for row in loop.ring[:8].tolist():
                out.extend(row[1:1 + row[0]])
        assert out[:16] == ref
    finally:
        loop.block_pool.free(blocks[::-1])

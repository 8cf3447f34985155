"""KIVI in the engine (kv_cache_dtype kivi4 / kivi2, cache/kivi_paged.py): a
short sequence (inside one block: all in the full-precision window) decodes
exactly as with a 16-bit cache, longer ones stay close, and the pool holds
about 3x the tokens."""
import pytest
import torch

from slipstream import SamplingParams
from tests.engine.conftest import assert_no_leak, make_llm, random_prompts


@pytest.fixture(scope="module")
def folder(tiny_folder):
    return tiny_folder("llama")[0]


def _run(folder, kv, prompts, max_tokens, **kw):
    llm = make_llm(folder, kv_cache_dtype=kv, block_size=16, num_kv_blocks=None,
                   kv_cache_memory=4 << 20, **kw)
    p = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1, ignore_eos=True)
    return llm, llm.generate(prompts, p, use_tqdm=False)


def test_inside_one_block_kivi_equals_a_16_bit_cache(folder):
    prompts = random_prompts(3, 100, 3, 8, seed=1)
    _, ref = _run(folder, "auto", prompts, 6)
    _, got = _run(folder, "kivi4", prompts, 6)       # <= 14 tokens: nothing sealed
    for a, b in zip(ref, got):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert {k: v.logprob for k, v in x.items()} == pytest.approx(
                {k: v.logprob for k, v in y.items()}, abs=1e-5)


def _prompt_logprobs(folder, kv, prompts):
    # Chunks of 16 prompt tokens: each chunk attends to the earlier ones as cached.
    llm = make_llm(folder, kv_cache_dtype=kv, block_size=16, num_kv_blocks=None,
                   kv_cache_memory=4 << 20, max_num_batched_tokens=16, max_num_seqs=4)
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    lps = [lp[t].logprob for o, p in zip(outs, prompts)
           for lp, t in zip(o.prompt_logprobs[1:], p["prompt_token_ids"][1:])]
    return llm, torch.tensor(lps)


def test_longer_prompts_stay_close_and_fit_more_tokens(folder):
    """Teacher-forced: the log-probability of each prompt token, the prompts
    computed in chunks (later chunks read the sealed blocks' 4- or 2-bit keys
    and values). A tiny random model (head_dim
    16) moves them a lot: measured mean 0.06 (kivi4) and 0.27 (kivi2); the bounds
    catch a wrong block or channel (whole units); the backend's exactness is
    tests/quant/test_kivi_paged.py's."""
    prompts = random_prompts(4, 100, 40, 90, seed=2)
    base, ref = _prompt_logprobs(folder, "auto", prompts)
    drift = {}
    for kv in ("kivi4", "kivi2"):
        llm, got = _prompt_logprobs(folder, kv, prompts)
        drift[kv] = (got - ref).abs().mean().item()
        assert llm.engine.runner.num_blocks > 3 * base.engine.runner.num_blocks
        layer = llm.engine.runner.model.attention_layers()[0]
        assert layer.kivi is not None and layer.k_cache.numel() == 0
    assert 0 < drift["kivi4"] < 0.2 and drift["kivi4"] < drift["kivi2"] < 1.0, drift


def test_triton_backend_decodes_kivi_like_the_torch_backend(folder, monkeypatch):
    """The Triton backend's decode steps go through the KIVI decode kernel (here
    under the interpreter); prompts through the torch path. Long enough that blocks
    are sealed while decoding (block 16, window 2 blocks + the partial one), so the
    kernel reads codes and window pages in the same request."""
    from slipstream.attention import triton_backend
    from slipstream.kernels.kivi_decode import kivi_decode_attention
    calls = []

    def counted(q, store, *a, **kw):
        calls.append(store.sealed_blocks(kw["max_seq_len"]) > 0)
        return kivi_decode_attention(q, store, *a, **kw)
    monkeypatch.setattr(triton_backend, "kivi_decode_attention", counted)
    prompts = random_prompts(2, 100, 20, 30, seed=4)
    p = SamplingParams(temperature=0.0, max_tokens=40, logprobs=1, ignore_eos=True)
    outs = {}
    for backend in ("torch", "triton"):
        llm = make_llm(folder, kv_cache_dtype="kivi4", block_size=16, num_kv_blocks=None,
                       kv_cache_memory=4 << 20, attention_backend=backend)
        outs[backend] = llm.generate(prompts, p, use_tqdm=False)
        layer = llm.engine.runner.model.attention_layers()[0]
        assert layer.kivi.window                       # windows of the finished requests
    assert len(calls) >= 39 and any(calls)             # decode steps, some over sealed blocks
    for a, b in zip(outs["torch"], outs["triton"]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert {k: v.logprob for k, v in x.items()} == pytest.approx(
                {k: v.logprob for k, v in y.items()}, abs=1e-4)


def test_kivi_rejects_other_backends(folder):
    with pytest.raises(ValueError, match="torch or triton"):
        make_llm(folder, kv_cache_dtype="kivi4", attention_backend="flash")


def test_preemption_and_prefix_hits_with_kivi(folder):
    """Requests preempted (recomputed) and prompts sharing a prefix (hits on sealed
    blocks) all finish, no block leaks, and the full-precision windows stay bounded:
    a finished request's window blocks are sealed or dropped."""
    tight = make_llm(folder, kv_cache_dtype="kivi4", block_size=16, num_kv_blocks=14,
                     max_model_len=128, max_num_seqs=8)
    shared = random_prompts(1, 100, 48, 48, seed=7)[0]["prompt_token_ids"]
    prompts = [{"prompt_token_ids": shared + p["prompt_token_ids"]}
               for p in random_prompts(6, 100, 4, 12, seed=8)]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    first = tight.generate(prompts[:1], params, use_tqdm=False)
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 30 for o in first + outs)
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert sum(o.num_cached_tokens for o in outs) >= 32
    assert_no_leak(tight)
    # Finished requests release their windows at the next step (the runner hears of
    # them then): what is left is at most the last requests' windows.
    for layer in tight.engine.runner.model.attention_layers():
        assert len(layer.kivi.window) <= 6 * (layer.kivi.residual + 1)
    tight.generate(prompts[:1], SamplingParams(max_tokens=1), use_tqdm=False)
    for layer in tight.engine.runner.model.attention_layers():
        assert len(layer.kivi.window) <= layer.kivi.residual + 1

"""Steps with prompt tokens in pieces around attention (runner/piecewise.py):
the pieces, padded to a token bucket, compute what the plain forward computes.
On the CPU the pieces run without graphs (SLIPSTREAM_PIECEWISE_GRAPHS=eager);
the captured version is checked on the GPU (test_gpu_runtime.py)."""
import pytest

from slipstream import SamplingParams
from slipstream.runner.piecewise import token_buckets
from tests.engine.conftest import make_llm, random_prompts


def test_token_buckets_cover_every_step_size():
    b = token_buckets(2048)
    assert b[0] == 16 and b[-1] == 2048 and b == sorted(set(b))
    assert all(y - x <= 64 for x, y in zip(b, b[1:]))
    assert token_buckets(100)[-1] == 100 and token_buckets(8)[-1] == 8


def _run(folder, monkeypatch, mode, arch_kw):
    monkeypatch.setenv("SLIPSTREAM_PIECEWISE_GRAPHS", mode)
    llm = make_llm(folder, max_num_batched_tokens=48, max_num_seqs=6, **arch_kw)
    pw = llm.engine.runner.piecewise
    used = []
    if pw is not None:
        run = pw.run
        pw.run = lambda batch: used.append((batch.num_tokens, batch.num_decode_seqs)) or run(batch)
    shared = random_prompts(1, 250, 30, 30, seed=7)[0]["prompt_token_ids"]
    prompts = random_prompts(9, 250, 3, 70, seed=5)
    prompts += [{"prompt_token_ids": shared + p["prompt_token_ids"][:5]} for p in prompts[:3]]
    params = [SamplingParams(max_tokens=12, temperature=0, logprobs=1, ignore_eos=True)] * 6 + \
             [SamplingParams(max_tokens=12, temperature=0.9, seed=i, ignore_eos=True,
                             prompt_logprobs=1 if i == 2 else None) for i in range(6)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return outs, used


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_pieces_match_the_plain_forward(tiny_folder, monkeypatch, arch):
    folder, _ = tiny_folder(arch)
    base, none = _run(folder, monkeypatch, "0", {})
    outs, used = _run(folder, monkeypatch, "eager", {})
    assert not none
    # Chunked prompts beside running decodes, and prompt-only steps, went through the pieces.
    assert any(d and n > d for n, d in used) and any(d == 0 for _, d in used)
    for a, b in zip(base, outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs or [], b.outputs[0].logprobs or []):
            assert {k: v.logprob for k, v in x.items()} == pytest.approx(
                {k: v.logprob for k, v in y.items()}, abs=1e-5)
        for x, y in zip(a.prompt_logprobs or [], b.prompt_logprobs or []):
            if x is not None:
                assert {k: v.logprob for k, v in x.items()} == pytest.approx(
                    {k: v.logprob for k, v in y.items()}, abs=1e-5)

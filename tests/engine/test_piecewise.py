"""Steps with prompt tokens in pieces around attention (runner/piecewise.py):
the pieces, padded to a token bucket, compute what the plain forward computes.
On the CPU the pieces run without graphs (SLIPSTREAM_PIECEWISE_GRAPHS=eager);
the captured version is checked on the GPU (test_gpu_runtime.py)."""
import os

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
    return outs, used, pw


@pytest.mark.parametrize("arch,backend", [("llama", "torch"), ("qwen2", "torch"),
                                          ("llama", "triton")])
def test_pieces_match_the_plain_forward(tiny_folder, monkeypatch, arch, backend):
    """triton: the GPU's path in Triton's interpreter, rotary fused into the KV store
    (q / k / v handed over as head slices of one output, written into `out`)."""
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton's interpreter runs on machines without a GPU (with one, "
                    "test_gpu_runtime.py runs the pieces through the compiled kernels)")
    folder, _ = tiny_folder(arch)
    kw = {}
    if backend == "triton":
        from slipstream.layers.rotary import RotaryEmbedding
        monkeypatch.setattr(RotaryEmbedding, "use_kernel", True)
        kw = dict(attention_backend="triton")
    base, none, _ = _run(folder, monkeypatch, "0", kw)
    outs, used, pw = _run(folder, monkeypatch, "eager", kw)
    assert not none
    # One copy of the QKV output a layer where q / k / v are slices of it.
    assert ({key[0] for key in pw._bufs} >= {"qkv", "out"}) == (backend == "triton")
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


def test_head_slices_of_one_output_are_copied_in_one_piece():
    import torch
    from slipstream.runner.piecewise import PiecewiseGraphs

    class _Model(torch.nn.Module):
        def attention_layers(self):
            return []
    pw = PiecewiseGraphs(_Model(), 64, torch.device("cpu"), mode="eager")
    # The projection's output is itself a view (a kernel that pads its rows).
    padded = torch.randn(40, 8 * 4 + 2 * 2 * 4)
    qkv = padded[:32].view(32, 12, 4)
    q, k, v = qkv[:, :8], qkv[:, 8:10], qkv[:, 10:]
    sq, sk, sv = pw._static_inputs(q, k, v, 32)
    assert [key[0] for key in pw._bufs] == ["qkv"]
    assert torch.equal(sq, q) and torch.equal(sk, k) and torch.equal(sv, v)
    assert sq.data_ptr() != q.data_ptr() and sq.stride() == q.stride()
    # Separate tensors: three copies.
    sq, sk, sv = pw._static_inputs(q.clone(), k.clone(), v.clone(), 32)
    assert sorted(key[0] for key in pw._bufs) == ["k", "q", "qkv", "v"]
    assert torch.equal(sq, q) and torch.equal(sv, v)


def test_pieces_under_speculation_with_feature_taps(tiny_folder, monkeypatch, tmp_path):
    """Speculative decoding keeps the pieces for steps without draft trees, and an
    EAGLE-3 head's feature taps (layer outputs beside the final states) pass
    through them: greedy tokens equal plain decoding without pieces."""
    from tests.engine.conftest import random_eagle_head
    folder, _ = tiny_folder("llama")
    random_eagle_head(folder, tmp_path / "e3.safetensors", "0,1")
    prompts = random_prompts(6, 250, 20, 60, seed=3)
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    monkeypatch.setenv("SLIPSTREAM_PIECEWISE_GRAPHS", "0")
    base = make_llm(folder, max_num_batched_tokens=48, max_num_seqs=4).generate(
        prompts, greedy, use_tqdm=False)
    monkeypatch.setenv("SLIPSTREAM_PIECEWISE_GRAPHS", "eager")
    llm = make_llm(folder, max_num_batched_tokens=48, max_num_seqs=4, speculative_method="eagle",
                   speculative_model=str(tmp_path / "e3.safetensors"), speculative_tree="2,2,3",
                   num_speculative_tokens=2, speculative_auto_off=False)
    pw = llm.engine.runner.piecewise
    used = []
    run = pw.run
    pw.run = lambda batch: used.append(batch.num_tokens) or run(batch)
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    assert used and llm.engine.runner.model.model.feature_taps == (0, 1)
    assert llm.engine.runner.speculator.stats.rounds > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in base]

"""On a GPU (CUDA only; run on the device with the benchmarks): the KIVI cache
on the torch backend, and online adaptation of an EAGLE head with bf16
drafting and an fp32 master."""
import pytest
import torch

from slipstream import SamplingParams
from tests.engine.conftest import cuda_llm as _llm
from tests.engine.conftest import random_eagle_head, random_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_kivi_on_cuda_inside_one_block_equals_a_16_bit_cache(tiny_folder):
    folder, _ = tiny_folder("llama")
    prompts = random_prompts(3, 100, 3, 8, seed=1)
    p = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in _llm(folder, attention_backend="torch").generate(
        prompts, p, use_tqdm=False)]
    llm = _llm(folder, kv_cache_dtype="kivi4", attention_backend="torch")
    assert llm.engine.runner.backend.name == "torch"   # (the triton backend: test_gpu_runtime.py)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, p, use_tqdm=False)] == ref
    long = random_prompts(2, 100, 60, 90, seed=2)          # sealed blocks too: runs, finite
    outs = llm.generate(long, SamplingParams(temperature=0.0, max_tokens=20, logprobs=1,
                                             ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 20 for o in outs)


def test_online_adaptation_on_cuda(tiny_folder, tmp_path):
    folder, _ = tiny_folder("llama")
    random_eagle_head(folder, tmp_path / "e3.safetensors", "0,1")
    prompts = [{"prompt_token_ids": [5 + i, 9, 14 + i, 3, 7] * 2} for i in range(4)]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in _llm(folder, dtype="bfloat16").generate(
        prompts, greedy, use_tqdm=False)]
    llm = _llm(folder, dtype="bfloat16", speculative_method="eagle",
               speculative_model=str(tmp_path / "e3.safetensors"), num_speculative_tokens=3,
               speculative_tree="2,2,4", speculative_auto_off=False, speculative_online=True)
    spec = llm.engine.runner.speculator
    online = spec.proposer.online
    online.every, online.steps = 64, 8
    for g in online.opt.param_groups:
        g["lr"] = 3e-3
    rates = []
    for _ in range(8):
        spec.stats.__init__()
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        rates.append(spec.stats.accepted / max(spec.stats.drafted, 1))
        # bf16: a batched verification may round a near-tie differently from one-token steps
        assert sum(a == b for a, b in zip(outs, plain)) >= 2
    assert online.stats["updates"] >= 3 and rates[-1] > rates[0] + 0.2, rates


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_speculation_over_a_quantized_kv_cache_on_cuda(tiny_folder, tmp_path, kv):
    """The Triton tree-attention and decode kernels read the int8 / fp8 codes a
    verification step stored, and accepted drafts move with their scales (float8
    as bytes): greedy outputs equal plain decoding over the same cache. fp32: a
    verification and one-token steps run different kernels, so allow one prompt of
    six a near-tie flip; a wrong code path changes them all."""
    folder, _ = tiny_folder("llama")
    prompts = [{"prompt_token_ids": [5 + i, 9, 14 + i, 3, 7] * 3} for i in range(6)]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in _llm(folder, kv_cache_dtype=kv).generate(
        prompts, greedy, use_tqdm=False)]
    random_eagle_head(folder, tmp_path / "e.safetensors")
    for method in ("ngram", "eagle"):
        kw = dict(speculative_method=method, num_speculative_tokens=3,
                  speculative_auto_off=False, kv_cache_dtype=kv)
        if method == "eagle":
            kw.update(speculative_model=str(tmp_path / "e.safetensors"), speculative_tree="3,2,6")
        llm = _llm(folder, **kw)
        assert llm.engine.runner.backend.name == "triton"
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        assert sum(a == b for a, b in zip(outs, plain)) >= 5, (method, outs, plain)
        assert llm.engine.runner.speculator.stats.rounds > 0

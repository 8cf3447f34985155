"""Weights into L2 on a side stream (kernels/l2_prefetch.py): the plan's syntax,
nothing launched off CUDA, and (on a GPU) decode graphs with the prefetch give
the same tokens and log-probs as without it."""
import pytest
import torch

from slipstream.kernels import l2_prefetch
from slipstream.kernels.l2_prefetch import parse_plan, plan_bytes, prefetch_l2


def test_plan_syntax():
    assert parse_plan("") is None and parse_plan("0") is None
    assert parse_plan("1") == l2_prefetch.DEFAULT_PLAN
    plan = parse_plan("o_proj=all, qkv=16,every=2")
    assert plan == {"o_proj": None, "qkv": 16.0, "every": 2.0}
    assert plan_bytes(plan, "o_proj") is None
    assert plan_bytes(plan, "qkv") == 16 << 20
    assert plan_bytes(plan, "down") is False
    for bad in ("o=all", "qkv", "qkv=", "gate_up=x"):
        with pytest.raises(ValueError):
            parse_plan(bad)


def test_nothing_is_launched_off_cuda():
    w = torch.randn(64, 64)
    assert prefetch_l2(w) == 0 and prefetch_l2(w, 1024, 2) == 0


def test_cpu_forward_ignores_the_plan(tiny_folder, monkeypatch):
    from slipstream import LLM, SamplingParams
    folder, _ = tiny_folder("llama")
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompt = {"prompt_token_ids": [3, 14, 15, 92, 65]}
    base = LLM(str(folder), dtype="float32").generate([prompt], params, use_tqdm=False)
    monkeypatch.setattr(l2_prefetch, "PLAN", {"o_proj": None, "qkv": 1.0})
    other = LLM(str(folder), dtype="float32").generate([prompt], params, use_tqdm=False)
    assert other[0].outputs[0].token_ids == base[0].outputs[0].token_ids


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_decode_graphs_with_prefetch_change_no_output(tiny_folder, monkeypatch):
    from slipstream import SamplingParams
    from tests.engine.conftest import cuda_llm, random_prompts
    folder, _ = tiny_folder("llama")
    prompts = random_prompts(5, 265, 5, 40, seed=8)
    params = SamplingParams(max_tokens=16, temperature=0, logprobs=1, ignore_eos=True)

    def run():
        outs = cuda_llm(folder, dtype="bfloat16").generate(prompts, params, use_tqdm=False)
        return [(o.outputs[0].token_ids,
                 [max(d.values(), key=lambda x: x.logprob).logprob for d in o.outputs[0].logprobs])
                for o in outs]

    base = run()
    monkeypatch.setattr(l2_prefetch, "PLAN", {"o_proj": None, "gate_up": 1.0, "down": 1.0,
                                              "qkv": 1.0, "every": 2})
    other = run()
    assert [t for t, _ in other] == [t for t, _ in base]
    assert [lp for _, lp in other] == [lp for _, lp in base]

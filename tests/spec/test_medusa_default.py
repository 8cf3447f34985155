"""Medusa with no tree named: the tree spans the head file's heads."""
from slipstream.spec.medusa import MedusaHeads, MedusaProposer, default_topk, static_tree


def test_default_tree_covers_every_head_and_no_more():
    assert default_topk(1) == (3,) and default_topk(3) == (3, 2, 1)
    assert default_topk(5) == (3, 2, 1, 1, 1)
    p = MedusaProposer(MedusaHeads(8, 3), lm_head=None)
    assert p.topk == (3, 2, 1) and len(p.parents) == len(static_tree((3, 2, 1))[0]) == 15


def test_default_model_with_shipped_heads_and_no_tree_is_exact():
    """`LLM(speculative_method="medusa")` on the default model, nothing else
    named: it builds, drafts and gives plain decoding's greedy tokens."""
    from slipstream import LLM, SamplingParams
    kw = dict(device="cpu", max_model_len=256, seed=0, kv_cache_memory=32 << 20)
    spec = LLM(**kw, speculative_method="medusa", speculative_auto_off=False)
    assert spec.engine.runner.speculator.proposer.topk == (3, 2, 1)
    plain = LLM(**kw)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = ["Name three primary colors."]
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    assert got == want and spec.engine.spec_stats.tau > 1.0

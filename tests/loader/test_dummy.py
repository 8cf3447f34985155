"""load_format="dummy": random weights of a config's or a preset's shape."""
from __future__ import annotations

import json

import pytest
import torch

from slipstream import LLM, SamplingParams
from slipstream.errors import ModelLoadError
from slipstream.loader import open_model
from slipstream.loader.dummy import IdTokenizer, initialize_dummy_weights, preset_config
from tests.models.tiny_models import VARIANTS, make_hf_model


def _config_folder(tmp_path, variant: str):
    """A folder with config.json only (no weights, no tokenizer)."""
    hf = make_hf_model(variant)
    d = {k: v for k, v in hf.config.to_dict().items() if v is not None}
    folder = tmp_path / variant
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(d))
    return folder


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_architecture_builds_and_generates(tmp_path, variant):
    folder = _config_folder(tmp_path, variant)
    llm = LLM(str(folder), load_format="dummy", dtype="float32", device="cpu",
              max_model_len=48, block_size=4, num_kv_blocks=64)
    mc = llm.engine.config.model_config
    model = llm.engine.runner.model
    if mc.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    params = [p for p in model.parameters()]
    assert all(p.abs().max() > 0 and p.isfinite().all() for p in params)
    prompts = [{"prompt_token_ids": [1, 5, 9, 2, 7, 30, 11]}, {"prompt_token_ids": [3, 4]}]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                        use_tqdm=False)
    for out in outs:
        ids = out.outputs[0].token_ids
        assert len(ids) == 12 and all(0 <= t < mc.vocab_size for t in ids)
        # The stand-in tokenizer writes ids as text.
        assert out.outputs[0].text.split() == [str(t) for t in ids]


def test_same_seed_same_weights_other_seed_differs(tmp_path):
    folder = _config_folder(tmp_path, "llama_gqa")
    kw = dict(load_format="dummy", dtype="float32", device="cpu", max_model_len=32,
              num_kv_blocks=16)
    a = LLM(str(folder), seed=1, **kw).engine.runner.model.state_dict()
    b = LLM(str(folder), seed=1, **kw).engine.runner.model.state_dict()
    c = LLM(str(folder), seed=2, **kw).engine.runner.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_init_scale_keeps_activations_finite_in_bf16():
    """A deep, wide-ish model in bf16: logits finite and not all equal."""
    from slipstream.attention.torch_backend import TorchAttentionBackend
    from slipstream.config import ModelConfig
    from slipstream.models.llama import LlamaForCausalLM
    from tests.models.batch_builder import BlockAllocator, Sequence, allocate_kv_caches, make_batch
    mc = ModelConfig("llama", vocab_size=300, hidden_size=256, intermediate_size=512,
                     num_hidden_layers=24, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=64, max_position_embeddings=64)
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = LlamaForCausalLM(mc, TorchAttentionBackend())
    finally:
        torch.set_default_dtype(torch.float32)
    initialize_dummy_weights(model, seed=0)
    norms = model.model.layers[0].input_layernorm.weight
    assert (norms - 1).abs().max() < 0.05 and (norms != 1).any()
    allocate_kv_caches(model, 8, 4, torch.bfloat16)
    batch = make_batch([(Sequence(list(range(1, 17)), 4, BlockAllocator(8)), 16)])
    with torch.inference_mode():
        model.backend.prepare(batch)
        logits = model.compute_logits(model(batch)[batch.logits_indices])
    assert logits.isfinite().all() and logits.std() > 0


def test_preset_config_and_errors():
    mc = preset_config("llama-3-8b")
    assert (mc.hidden_size, mc.num_hidden_layers, mc.num_key_value_heads, mc.vocab_size) == \
        (4096, 32, 8, 128256)
    assert preset_config("Qwen2.5 72B").attention_bias
    with pytest.raises(ModelLoadError, match="not a Llama-family"):
        preset_config("deepseek-v3")
    with pytest.raises(ModelLoadError, match="neither a path nor a preset"):
        open_model("no-such-model", "dummy")
    with pytest.raises(ValueError, match="load_format"):
        open_model(None, "pt")
    with pytest.raises(ModelLoadError, match="--load-format dummy"):
        open_model("llama-3-8b")
    files = open_model("llama-3-8b", "dummy")
    tok = files.tokenizer()
    assert isinstance(tok, IdTokenizer) and tok.encode("12 7 4051") == [12, 7, 4051]
    assert tok.decode([12, 7]) == "12 7"
    with pytest.raises(ValueError, match="token ids"):
        tok.encode("hello")


def test_default_model_shape_with_dummy_weights():
    """No model named: the default model's config and tokenizer, random weights."""
    real = open_model(None)
    files = open_model(None, "dummy")
    assert files.config == real.config
    assert files.tokenizer().encode("Hello") == real.tokenizer().encode("Hello")

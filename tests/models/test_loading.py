"""load_weights: HF names in, clear ModelLoadErrors out."""
from __future__ import annotations

import pytest
import torch

from slipstream.attention.torch_backend import TorchAttentionBackend
from slipstream.errors import ModelLoadError
from slipstream.models.llama import LlamaForCausalLM
from tests.models.tiny_models import make_hf_model, model_config_of


def _fresh(variant: str):
    hf = make_hf_model(variant)
    return hf, LlamaForCausalLM(model_config_of(hf), TorchAttentionBackend())


def test_fused_shards_land_in_place():
    hf, ours = _fresh("qwen2_bias")
    ours.load_weights(hf.state_dict().items())
    attn, ref = ours.model.layers[1].self_attn.qkv_proj, hf.model.layers[1].self_attn
    torch.testing.assert_close(attn.weight, torch.cat(
        [ref.q_proj.weight, ref.k_proj.weight, ref.v_proj.weight]), rtol=0, atol=0)
    torch.testing.assert_close(attn.bias, torch.cat(
        [ref.q_proj.bias, ref.k_proj.bias, ref.v_proj.bias]), rtol=0, atol=0)
    mlp, ref_mlp = ours.model.layers[1].mlp.gate_up_proj, hf.model.layers[1].mlp
    torch.testing.assert_close(mlp.weight, torch.cat(
        [ref_mlp.gate_proj.weight, ref_mlp.up_proj.weight]), rtol=0, atol=0)


def test_tied_embeddings_need_no_lm_head():
    hf, ours = _fresh("smollm2_tied")
    ours.load_weights((k, v) for k, v in hf.state_dict().items() if k != "lm_head.weight")
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    ours.to(torch.bfloat16)  # the tie survives a dtype change
    assert ours.lm_head.weight is ours.model.embed_tokens.weight


def test_rotary_buffers_are_ignored():
    hf, ours = _fresh("llama2")
    extra = [("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(8))]
    ours.load_weights(list(hf.state_dict().items()) + extra)


def test_missing_tensor_is_named():
    hf, ours = _fresh("llama_gqa")
    sd = {k: v for k, v in hf.state_dict().items() if k != "model.layers.1.self_attn.k_proj.weight"}
    with pytest.raises(ModelLoadError, match=r"missing.*model\.layers\.1\.self_attn\.k_proj\.weight"):
        ours.load_weights(sd.items())


def test_untied_model_needs_lm_head():
    hf, ours = _fresh("llama2")
    sd = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    with pytest.raises(ModelLoadError, match=r"missing.*lm_head\.weight"):
        ours.load_weights(sd.items())


def test_unexpected_tensor_is_named():
    hf, ours = _fresh("llama2")
    sd = dict(hf.state_dict())
    sd["model.layers.0.mlp.gate_proj.bias"] = torch.zeros(96)
    with pytest.raises(ModelLoadError, match=r"unexpected.*model\.layers\.0\.mlp\.gate_proj\.bias"):
        ours.load_weights(sd.items())


def test_shape_mismatch_is_named():
    hf, ours = _fresh("llama_gqa")
    sd = dict(hf.state_dict())
    sd["model.layers.0.self_attn.v_proj.weight"] = torch.zeros(64, 64)
    with pytest.raises(ModelLoadError, match=r"v_proj\.weight.*\(64, 64\).*\(16, 64\)"):
        ours.load_weights(sd.items())

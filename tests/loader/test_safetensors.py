"""Hugging Face folders written by transformers' save_pretrained."""
from __future__ import annotations

import copy
import json

import pytest
import torch

from slipstream.loader import open_model


@pytest.mark.parametrize("arch,tie,shard", [
    ("llama", False, False), ("llama", True, False), ("llama", False, True),
    ("qwen2", False, False), ("mistral", False, True),
])
def test_weights_equal_transformers(save_hf, tiny_model, arch, tie, shard):
    folder = save_hf(arch, tie=tie, shard=shard)
    if shard:
        assert (folder / "model.safetensors.index.json").is_file()
    files = open_model(folder)
    ours = dict(files.weights())
    expected = {k: v for k, v in tiny_model(arch, tie).state_dict().items()
                if not (tie and k == "lm_head.weight")}
    assert set(ours) == set(expected)
    for name, tensor in ours.items():
        assert torch.equal(tensor, expected[name]), name
    assert files.config.architecture == arch and files.config.tie_word_embeddings == tie


def test_config(save_hf):
    cfg = open_model(save_hf("mistral")).config
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (256, 4, 2, 64)
    assert cfg.sliding_window == 64 and cfg.eos_token_ids == (2,)
    assert open_model(save_hf("qwen2")).config.attention_bias


def test_generation_config_adds_stop_ids(save_hf):
    folder = save_hf("llama")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 1]}))
    files = open_model(folder)
    assert files.config.eos_token_ids == (2, 1)
    assert files.tokenizer().eos_token_ids == (2, 1)


def test_bfloat16_checkpoint_keeps_its_dtype(tmp_path, tiny_model):
    folder = tmp_path / "bf16"
    copy.deepcopy(tiny_model("llama")).to(torch.bfloat16).save_pretrained(folder)
    name, tensor = next(iter(open_model(folder).weights()))
    assert tensor.dtype == torch.bfloat16


def test_rotary_buffers_and_tied_lm_head_are_skipped(save_hf, tiny_model):
    from safetensors.torch import save_file
    folder = save_hf("llama", tie=True)
    sd = dict(tiny_model("llama", tie=True).state_dict())
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(32)
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
    save_file(sd, str(folder / "model.safetensors"))
    names = {name for name, _ in open_model(folder).weights()}
    assert "lm_head.weight" not in names and not any("inv_freq" in n for n in names)

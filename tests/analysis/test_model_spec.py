"""Model descriptions: presets equal what their published config.json says."""
import json

import pytest

from slipstream.analysis.hf_config import spec_from_hf_config
from slipstream.analysis.model_spec import ModelSpec
from slipstream.analysis.presets import PRESETS, resolve_model
from slipstream.config import ModelConfig

# The keys that matter, as published on the Hugging Face Hub.
_LLAMA4_TEXT = dict(model_type="llama4_text", hidden_size=5120, intermediate_size=8192,
                    intermediate_size_mlp=16384, num_hidden_layers=48, num_attention_heads=40,
                    num_key_value_heads=8, head_dim=128, num_experts_per_tok=1,
                    attention_chunk_size=8192, vocab_size=202048,
                    no_rope_layers=[1, 1, 1, 0] * 12)
HF_CONFIGS = {
    "deepseek-v3": dict(
        model_type="deepseek_v3", hidden_size=7168, intermediate_size=18432,
        moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
        num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256,
        num_experts_per_tok=8, first_k_dense_replace=3, moe_layer_freq=1, kv_lora_rank=512,
        q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        vocab_size=129280, tie_word_embeddings=False),
    "qwen3-235b-a22b": dict(
        model_type="qwen3_moe", hidden_size=4096, intermediate_size=12288,
        moe_intermediate_size=1536, num_hidden_layers=94, num_attention_heads=64,
        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        decoder_sparse_step=1, mlp_only_layers=[], vocab_size=151936,
        tie_word_embeddings=False, use_sliding_window=False, sliding_window=None),
    "llama-4-scout": dict(model_type="llama4", tie_word_embeddings=False, text_config=dict(
        _LLAMA4_TEXT, num_local_experts=16, interleave_moe_layer_step=1)),
    "llama-4-maverick": dict(model_type="llama4", tie_word_embeddings=False, text_config=dict(
        _LLAMA4_TEXT, num_local_experts=128, interleave_moe_layer_step=2)),
    "gemma-3-27b": dict(model_type="gemma3", text_config=dict(
        model_type="gemma3_text", hidden_size=5376, intermediate_size=21504,
        num_hidden_layers=62, num_attention_heads=32, num_key_value_heads=16, head_dim=128,
        sliding_window=1024, sliding_window_pattern=6, vocab_size=262208)),
    "qwen2.5-72b": dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=8192,
        intermediate_size=29568, num_hidden_layers=80, num_attention_heads=64,
        num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False,
        use_sliding_window=False, sliding_window=131072),
    "llama-2-70b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=8192,
        intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
        num_key_value_heads=8, vocab_size=32000, tie_word_embeddings=False),
}


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_preset_equals_published_config(name):
    assert spec_from_hf_config(HF_CONFIGS[name], name=name) == PRESETS[name]


def test_layer_layout_of_the_chapter_models():
    ds, mav, gemma = PRESETS["deepseek-v3"], PRESETS["llama-4-maverick"], PRESETS["gemma-3-27b"]
    # DeepSeek-V3: first 3 layers dense, the other 58 MoE.
    assert [ds.is_moe_layer(i) for i in range(61)] == [False] * 3 + [True] * 58
    # Maverick alternates dense and MoE, starting dense: 24 of each.
    assert [mav.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    assert sum(mav.is_moe_layer(i) for i in range(48)) == 24
    # Gemma 3: five 1024-token sliding layers, then one global.
    assert [gemma.layer_window(i) for i in range(6)] == [1024] * 5 + [None]
    assert sum(gemma.layer_window(i) is None for i in range(62)) == 10
    # MLA caches 512 + 64 elements per token per layer; GQA caches 2 x kv_heads x head_dim.
    assert ds.kv_elements_per_token == 576
    assert PRESETS["llama-3-8b"].kv_elements_per_token == 2 * 8 * 128


def test_from_loaded_model_config():
    cfg = ModelConfig(architecture="qwen2", vocab_size=1000, hidden_size=64, intermediate_size=160,
                      num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
                      head_dim=8, max_position_embeddings=256, tie_word_embeddings=True,
                      attention_bias=True, sliding_window=32)
    spec = resolve_model(cfg)
    assert spec == ModelSpec("qwen2", 64, 3, 8, 2, 8, 160, 1000, tie_word_embeddings=True,
                             attention_bias=True, window=32)
    assert spec.layer_window(2) == 32   # Mistral-style: every layer windowed


@pytest.mark.parametrize("spelling", ["LLaMA-3 8B", "llama3-8b", "llama-3.1-8b", "Llama_3_8B"])
def test_preset_spellings(spelling):
    assert resolve_model(spelling) is PRESETS["llama-3-8b"]


def test_config_json_file_and_folder(tmp_path):
    folder = tmp_path / "Qwen2.5-72B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(HF_CONFIGS["qwen2.5-72b"]))
    by_folder, by_file = resolve_model(str(folder)), resolve_model(folder / "config.json")
    assert by_folder.name == by_file.name == "Qwen2.5-72B"
    assert by_folder == by_file
    assert by_folder.attention_bias and by_folder.window is None


def test_unknown_model_and_unreadable_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="unknown model"):
        resolve_model("no-such-model")
    junk = tmp_path / "model.gguf"
    junk.write_bytes(b"not a gguf file")
    with pytest.raises(ValueError):
        resolve_model(str(junk))


def test_invalid_head_grouping():
    with pytest.raises(ValueError, match="KV groups"):
        ModelSpec("bad", 64, 1, 6, 4, 8, 128, 100)


def test_checkpoint_through_the_engine_loader():
    loader = pytest.importorskip("slipstream.loader")
    try:
        path = loader.default_model_path()
    except ValueError:
        pytest.skip("default GGUF model not installed")
    spec = resolve_model(str(path))
    # SmolLM2-135M: d 576, 30 layers, 9 query / 3 KV heads of 64, d_ff 1536, tied 49152 vocab.
    assert (spec.hidden_size, spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim,
            spec.intermediate_size, spec.vocab_size, spec.tie_word_embeddings) == \
        (576, 30, 9, 3, 64, 1536, 49152, True)

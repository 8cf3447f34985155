"""Tiny random Hugging Face models, one per supported architecture variant, and
slipstream twins loaded from their state dicts."""
from __future__ import annotations

import torch

from slipstream.attention.torch_backend import TorchAttentionBackend
from slipstream.config import ModelConfig
from slipstream.models.hf_config import model_config_from_hf
from slipstream.models.llama import LlamaForCausalLM

_BASE = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
             rms_norm_eps=1e-5)

# name -> (HF class name, config overrides)
VARIANTS = {
    "llama2": ("LlamaForCausalLM", {}),
    "llama_gqa": ("LlamaForCausalLM", dict(num_attention_heads=8, num_key_value_heads=2)),
    "llama3_rope": ("LlamaForCausalLM", dict(
        num_key_value_heads=2, max_position_embeddings=128,
        # head_dim 16, theta 1e4: wavelengths 6.3 (kept), 20 and 63 (smoothed), >= 199 (scaled)
        rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0,
                             low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=64))),
    "llama_linear_rope": ("LlamaForCausalLM", dict(
        rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0))),
    "llama_attention_bias": ("LlamaForCausalLM", dict(attention_bias=True)),
    "llama_head_dim": ("LlamaForCausalLM", dict(hidden_size=48, head_dim=16,
                                                num_key_value_heads=2)),
    "smollm2_tied": ("LlamaForCausalLM", dict(tie_word_embeddings=True, num_key_value_heads=2)),
    "qwen2_bias": ("Qwen2ForCausalLM", dict(num_key_value_heads=2, rope_theta=1e6)),
    "mistral_window": ("MistralForCausalLM", dict(num_key_value_heads=2, sliding_window=5)),
}


def make_hf_model(variant: str, seed: int = 0):
    """A random fp32 HF model in eval mode. Every parameter (biases and norm
    weights included, which HF initialises to constants) gets random values."""
    import transformers
    cls_name, overrides = VARIANTS[variant]
    cls = getattr(transformers, cls_name)
    config = cls.config_class(**{**_BASE, **overrides}, attn_implementation="eager")
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.15)
    return model


def model_config_of(hf_model) -> ModelConfig:
    # A config.json on disk omits unset fields; to_dict() writes them as None.
    d = {k: v for k, v in hf_model.config.to_dict().items() if v is not None}
    return model_config_from_hf(d)


def make_ours(hf_model, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    model = LlamaForCausalLM(model_config_of(hf_model), TorchAttentionBackend()).to(dtype)
    model.load_weights(hf_model.state_dict().items())
    return model.eval()

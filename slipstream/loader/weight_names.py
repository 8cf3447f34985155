"""The Hugging Face parameter names a Llama-family checkpoint must hold.

Both loaders speak these names, so the model never learns which file format
it came from. A tied model has no `lm_head.weight`: the model reuses the
embedding.
"""
from __future__ import annotations

from slipstream.config import ModelConfig
from slipstream.errors import ModelLoadError

_LAYER_WEIGHTS = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)
_LAYER_BIASES = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")


def expected_weight_names(config: ModelConfig) -> list[str]:
    """Every parameter name the model consumes, in a stable order."""
    names = ["model.embed_tokens.weight"]
    per_layer = _LAYER_WEIGHTS + (_LAYER_BIASES if config.attention_bias else ())
    for i in range(config.num_hidden_layers):
        names += [f"model.layers.{i}.{suffix}" for suffix in per_layer]
    names.append("model.norm.weight")
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


def check_complete(available: set[str], config: ModelConfig, where: str) -> None:
    """Raise one ModelLoadError naming the missing tensors, if any are missing."""
    missing = [name for name in expected_weight_names(config) if name not in available]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelLoadError(
            f"{where}: the checkpoint lacks {len(missing)} tensor(s) the "
            f"{config.architecture} model needs: {shown}")

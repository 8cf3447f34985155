"""Which Hugging Face architectures map to which slipstream model class."""
from __future__ import annotations

from dataclasses import dataclass

from slipstream.errors import ModelLoadError

# HF `architectures[0]` -> canonical family key. All of these share one
# implementation (models/llama.py); the key selects family defaults
# (e.g. Qwen2's q/k/v bias).
_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}


@dataclass(frozen=True)
class FamilyTraits:
    """What sets a family apart beyond the fields of ModelConfig."""
    # HF Llama's `attention_bias` puts a bias on o_proj as well as on q/k/v;
    # Qwen2 biases only q/k/v.
    o_proj_bias_with_attention_bias: bool = False


_FAMILY_TRAITS = {
    "llama": FamilyTraits(o_proj_bias_with_attention_bias=True),
    "mistral": FamilyTraits(),
    "qwen2": FamilyTraits(),
}


def family_traits(architecture: str) -> FamilyTraits:
    try:
        return _FAMILY_TRAITS[architecture]
    except KeyError:
        raise ModelLoadError(f"unsupported model architecture {architecture!r}") from None


def resolve_architecture(hf_config: dict) -> str:
    archs = hf_config.get("architectures") or []
    for name in archs:
        if name in _ARCHITECTURES:
            return _ARCHITECTURES[name]
    model_type = hf_config.get("model_type")
    if not archs and model_type in _MODEL_TYPES:
        return _MODEL_TYPES[model_type]
    got = archs[0] if archs else model_type
    raise ModelLoadError(
        f"unsupported model architecture {got!r}; slipstream supports "
        f"{', '.join(sorted(_ARCHITECTURES))}")


def model_class(architecture: str):
    from slipstream.models.llama import LlamaForCausalLM
    if architecture not in _MODEL_TYPES.values():
        raise ModelLoadError(f"unsupported model architecture {architecture!r}")
    return LlamaForCausalLM

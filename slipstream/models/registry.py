"""Which Hugging Face architectures map to which slipstream model class."""
from __future__ import annotations

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

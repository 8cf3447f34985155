"""Hugging Face `config.json` -> ModelConfig (GGUF metadata is mapped to the same dict)."""
from __future__ import annotations

from slipstream.config import ModelConfig, RopeScaling
from slipstream.errors import ModelLoadError
from slipstream.models.registry import resolve_architecture


def model_config_from_hf(cfg: dict) -> ModelConfig:
    """Build from a Hugging Face `config.json` dict; raise ModelLoadError when
    it is unsupported or incomplete."""
    try:
        return _parse(cfg)
    except KeyError as e:
        raise ModelLoadError(f"the model config lacks the required key {e.args[0]!r}") from None


def _parse(cfg: dict) -> ModelConfig:
    # HF's to_dict() writes unset options as None: treat None as "not given".
    cfg = {k: v for k, v in cfg.items() if v is not None}
    arch = resolve_architecture(cfg)
    heads = cfg["num_attention_heads"]
    hidden = cfg["hidden_size"]
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    scaling = None
    if rope:
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3", "linear"):
            raise ModelLoadError(f"unsupported rope_scaling type {rope_type!r}")
        if rope_type != "default":
            scaling = RopeScaling(
                rope_type=rope_type,
                factor=float(rope.get("factor", 1.0)),
                low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
                high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
                original_max_position_embeddings=int(
                    rope.get("original_max_position_embeddings", 8192)),
            )
    theta = cfg.get("rope_theta")
    if theta is None and rope:
        theta = rope.get("rope_theta")
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    # Mistral uses its window unless told otherwise; Qwen2 only when told to.
    window = cfg.get("sliding_window")
    if not cfg.get("use_sliding_window", arch != "qwen2"):
        window = None
    return ModelConfig(
        architecture=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or hidden // heads,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
        rope_theta=float(theta if theta is not None else 10000.0),
        rope_scaling=scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
        sliding_window=window,
        hidden_act=cfg.get("hidden_act", "silu"),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )

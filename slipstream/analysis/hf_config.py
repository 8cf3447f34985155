"""Reading a Hugging Face `config.json` into a ModelSpec.

Families name the same things differently (experts: `n_routed_experts`,
`num_local_experts`, `num_experts`), so each family that departs from the
Llama keys has a small reader in `_FAMILIES`; the base reader covers the rest.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from slipstream.analysis.model_spec import MLASpec, MoESpec, ModelSpec


def _period(flags: list[bool]) -> int:
    """Layer i is global when (i + 1) % period == 0; recover period from a
    per-layer list (assumed periodic, as in every published config)."""
    return flags.index(True) + 1 if True in flags else 0


def _base(c: dict) -> dict:
    heads = c["num_attention_heads"]
    use_window = c.get("use_sliding_window", c.get("model_type") != "qwen2")
    kw = dict(
        hidden_size=c["hidden_size"],
        num_layers=c["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=c.get("num_key_value_heads") or heads,
        head_dim=c.get("head_dim") or c["hidden_size"] // heads,
        intermediate_size=c["intermediate_size"],
        vocab_size=c["vocab_size"],
        # PretrainedConfig's default is tied; Llama-family configs say false.
        tie_word_embeddings=bool(c.get("tie_word_embeddings", True)),
        attention_bias=bool(c.get("attention_bias", c.get("model_type") == "qwen2")),
        window=c.get("sliding_window") if use_window else None,
    )
    if "layer_types" in c:
        kw["global_every"] = _period([t == "full_attention" for t in c["layer_types"]])
    return kw


def _gemma(c: dict) -> dict:
    gemma3 = c.get("model_type", "").startswith("gemma3")
    kw = dict(qk_norm=gemma3, norms_per_layer=4)
    if "layer_types" not in c:
        # Gemma 2 alternates local and global layers; Gemma 3 has five local per global.
        kw["global_every"] = c.get("sliding_window_pattern", 6 if gemma3 else 2)
    return kw


def _qwen3(c: dict) -> dict:
    return dict(qk_norm=True, **_qwen_moe(c))


def _qwen_moe(c: dict) -> dict:
    if not c.get("num_experts"):
        return {}
    shared_width = c.get("shared_expert_intermediate_size") or 0
    return dict(moe=MoESpec(
        num_experts=c["num_experts"],
        experts_per_token=c["num_experts_per_tok"],
        expert_intermediate_size=c["moe_intermediate_size"],
        num_shared_experts=1 if shared_width else 0,
        shared_intermediate_size=shared_width or None,
        every=c.get("decoder_sparse_step", 1),
    ))


def _mixtral(c: dict) -> dict:
    return dict(moe=MoESpec(c["num_local_experts"], c["num_experts_per_tok"], c["intermediate_size"]))


def _llama4(c: dict) -> dict:
    # Experts (and the one shared expert) use intermediate_size; the dense
    # layers between MoE layers use intermediate_size_mlp.
    flags = c.get("no_rope_layers")
    every = _period([not f for f in flags]) if flags else c.get("no_rope_layer_interval", 4)
    return dict(
        intermediate_size=c.get("intermediate_size_mlp", c["intermediate_size"]),
        window=c.get("attention_chunk_size"), window_kind="chunked", global_every=every,
        moe=MoESpec(c["num_local_experts"], c["num_experts_per_tok"], c["intermediate_size"],
                    num_shared_experts=1, every=c.get("interleave_moe_layer_step", 1)),
    )


def _deepseek(c: dict) -> dict:
    return dict(
        head_dim=c["qk_nope_head_dim"] + c["qk_rope_head_dim"],
        moe=MoESpec(
            num_experts=c["n_routed_experts"],
            experts_per_token=c["num_experts_per_tok"],
            expert_intermediate_size=c["moe_intermediate_size"],
            num_shared_experts=c.get("n_shared_experts") or 0,
            first_dense_layers=c.get("first_k_dense_replace", 0),
            every=c.get("moe_layer_freq", 1),
        ),
        mla=MLASpec(c["kv_lora_rank"], c["qk_nope_head_dim"], c["qk_rope_head_dim"],
                    c["v_head_dim"], c.get("q_lora_rank")),
    )


_FAMILIES: dict[str, Callable[[dict], dict]] = {
    "gemma2": _gemma, "gemma3": _gemma, "gemma3_text": _gemma,
    "qwen3": _qwen3, "qwen3_moe": _qwen3, "qwen2_moe": _qwen_moe,
    "mixtral": _mixtral,
    "llama4": _llama4, "llama4_text": _llama4,
    "deepseek_v2": _deepseek, "deepseek_v3": _deepseek,
}


def spec_from_hf_config(cfg: dict, name: str = "model") -> ModelSpec:
    """Multimodal configs keep the language model under `text_config`."""
    text = dict(cfg.get("text_config") or cfg)
    text.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", True))
    kw = _base(text)
    family = _FAMILIES.get(text.get("model_type", ""))
    if family is not None:
        kw.update(family(text))
    return ModelSpec(name=name, **kw)


def load_hf_config(path: str | Path) -> ModelSpec:
    """From a `config.json` file or a folder that holds one."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    name = file.parent.name if file.name == "config.json" else file.stem
    return spec_from_hf_config(json.loads(file.read_text()), name=name)

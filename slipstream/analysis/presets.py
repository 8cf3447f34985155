"""Every model in the reference chapter's tables, from its published config.json,
and `resolve_model`, which turns whatever a user names into a ModelSpec.

Shapes are the language model only (Gemma 3 and Llama 4 also ship a vision
encoder, which a text-only decode step never runs).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from slipstream.analysis.hf_config import load_hf_config
from slipstream.analysis.model_spec import MLASpec, MoESpec, ModelSpec


def _key(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


_LLAMA4 = dict(hidden_size=5120, num_layers=48, num_heads=40, num_kv_heads=8, head_dim=128,
               intermediate_size=16384, vocab_size=202048,
               # iRoPE: three chunked-attention layers (8192-token chunks) per global one
               window=8192, window_kind="chunked", global_every=4)

PRESETS: dict[str, ModelSpec] = {s.name: s for s in (
    ModelSpec("llama-3-8b", 4096, 32, 32, 8, 128, 14336, 128256),
    ModelSpec("gemma-3-27b", 5376, 62, 32, 16, 128, 21504, 262208, tie_word_embeddings=True,
              qk_norm=True, norms_per_layer=4, window=1024, global_every=6),
    ModelSpec("qwen2.5-72b", 8192, 80, 64, 8, 128, 29568, 152064, attention_bias=True),
    ModelSpec("llama-3.1-405b", 16384, 126, 128, 8, 128, 53248, 128256),
    ModelSpec("llama-4-scout", **_LLAMA4,
              moe=MoESpec(16, 1, 8192, num_shared_experts=1)),
    ModelSpec("llama-4-maverick", **_LLAMA4,
              moe=MoESpec(128, 1, 8192, num_shared_experts=1, every=2)),
    ModelSpec("qwen3-235b-a22b", 4096, 94, 64, 4, 128, 12288, 151936, qk_norm=True,
              moe=MoESpec(128, 8, 1536)),
    ModelSpec("deepseek-v3", 7168, 61, 128, 128, 192, 18432, 129280,
              moe=MoESpec(256, 8, 2048, num_shared_experts=1, first_dense_layers=3),
              mla=MLASpec(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                          v_head_dim=128, q_lora_rank=1536)),
    ModelSpec("llama-2-70b", 8192, 80, 64, 8, 128, 28672, 32000),
)}

_ALIASES = {_key(a): name for a, name in (
    ("llama3-8b", "llama-3-8b"), ("llama-3.1-8b", "llama-3-8b"),
    ("llama3.1-405b", "llama-3.1-405b"), ("qwen3-235b", "qwen3-235b-a22b"),
    ("deepseek-r1", "deepseek-v3"), ("llama4-scout", "llama-4-scout"),
    ("llama4-maverick", "llama-4-maverick"), ("llama2-70b", "llama-2-70b"),
)} | {_key(name): name for name in PRESETS}


@dataclass(frozen=True)
class ChapterClaim:
    """What the chapter's tables state for a model (section 1.1), in billions."""
    params: float
    active: float
    gflops_per_token: float


CHAPTER_CLAIMS = {
    "llama-3-8b": ChapterClaim(8, 8, 16),
    "gemma-3-27b": ChapterClaim(27, 27, 54),
    "qwen2.5-72b": ChapterClaim(72, 72, 144),
    "llama-3.1-405b": ChapterClaim(405, 405, 810),
    "llama-4-scout": ChapterClaim(109, 17, 34),
    "llama-4-maverick": ChapterClaim(400, 17, 34),
    "qwen3-235b-a22b": ChapterClaim(235, 22, 44),
    "deepseek-v3": ChapterClaim(671, 37, 74),
    "llama-2-70b": ChapterClaim(70, 70, 140),   # section 1.2: 140 GB, 140 GFLOPs
}


def _from_loader(path: Path) -> ModelSpec:
    """A checkpoint the engine's loader understands (GGUF, safetensors folder)."""
    try:
        from slipstream.loader import open_model
    except ImportError:
        raise ValueError(f"{path}: no config.json there, and this build has no model "
                         "loader to read it") from None
    return ModelSpec.from_model_config(open_model(str(path)).config, name=path.stem)


def resolve_model(ref) -> ModelSpec:
    """A ModelSpec, a loaded ModelConfig, a preset name (any spelling: "LLaMA-3 8B"),
    a config.json or a folder holding one, or a checkpoint the loader reads."""
    if isinstance(ref, ModelSpec):
        return ref
    if not isinstance(ref, (str, Path)):
        return ModelSpec.from_model_config(ref)
    if _key(str(ref)) in _ALIASES:
        return PRESETS[_ALIASES[_key(str(ref))]]
    path = Path(ref)
    if path.suffix == ".json" or (path.is_dir() and (path / "config.json").is_file()):
        return load_hf_config(path)
    if path.exists():
        return _from_loader(path)
    raise ValueError(f"unknown model {str(ref)!r}: use a preset ({', '.join(PRESETS)}), "
                     "a config.json path, or a model folder")

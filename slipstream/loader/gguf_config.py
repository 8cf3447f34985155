"""A ModelConfig from GGUF metadata.

The metadata is llama.cpp's spelling of config.json (`llama.block_count`,
`llama.attention.head_count_kv`, ...). It is turned into a config.json-style
dict and handed to `model_config_from_hf`, so both formats share one set
of defaults and checks.
"""
from __future__ import annotations

import math

import numpy as np

from slipstream.config import ModelConfig
from slipstream.errors import ModelLoadError
from slipstream.models.hf_config import model_config_from_hf

# general.architecture -> (HF architecture, do llama.cpp's converters permute q/k rows?)
GGUF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
}


def eos_ids(meta: dict) -> tuple[int, ...]:
    """End-of-sequence ids: eos, and the end-of-turn / end-of-message ids Llama 3 files add."""
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    return tuple(dict.fromkeys(int(meta[k]) for k in keys if meta.get(k) is not None))


def _llama3_scaling(freq_factors: np.ndarray, head_dim: int, theta: float) -> dict:
    """llama.cpp stores Llama 3.x's RoPE scaling only as per-frequency factors
    (tensor `rope_freqs.weight`). Meta's released models all use low/high frequency
    factors 1 and 4 over an original 8192 context; rebuild those factors and
    insist they match the file, so a file with other parameters fails loudly."""
    # the factors are float32: keep the shortest decimal that reads back the same (8.0, not 7.9999995)
    factor, low, high, original = float(str(np.float32(freq_factors.max()))), 1.0, 4.0, 8192
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    expected = np.where(wavelen < original / high, 1.0,
                        np.where(wavelen > original / low, factor, 1 / ((1 - smooth) / factor + smooth)))
    if expected.shape != freq_factors.shape or not np.allclose(expected, freq_factors, rtol=1e-3):
        raise ModelLoadError(
            "the GGUF file's rope_freqs.weight is not Llama 3 RoPE scaling with low/high frequency "
            "factors 1/4 over 8192 positions; slipstream cannot tell which scaling it encodes")
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
            "high_freq_factor": high, "original_max_position_embeddings": original}


def config_from_gguf(meta: dict, tensor_names: set[str], n_tokens: int | None,
                     rope_freqs: np.ndarray | None, where: str) -> ModelConfig:
    """`meta`: metadata as plain values; `n_tokens`: the vocabulary's length;
    `rope_freqs`: the `rope_freqs.weight` tensor, if any."""
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"{where}: unsupported GGUF architecture {arch!r}; slipstream supports "
            f"{', '.join(sorted(GGUF_ARCHITECTURES))}")

    def key(name: str, default=None):
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ModelLoadError(f"{where}: the GGUF metadata lacks {arch}.{name}")
        return value

    heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or meta.get(f"{arch}.rope.dimension_count")
                   or hidden // heads)
    theta = float(key("rope.freq_base", 10000.0))
    rope = None
    scaling_type = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling_type not in ("none", None):
        rope = {"rope_type": scaling_type, "factor": float(key("rope.scaling.factor", 1.0))}
    elif rope_freqs is not None:
        rope = _llama3_scaling(rope_freqs, head_dim, theta)
    eos = eos_ids(meta)
    cfg = {
        "architectures": [GGUF_ARCHITECTURES[arch][0]],
        "vocab_size": int(meta.get(f"{arch}.vocab_size") or n_tokens or 0),
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "max_position_embeddings": int(key("context_length", 2048)),
        # stored as float32: 1e-5 reads back as 9.99999975e-06; keep the written value
        "rms_norm_eps": float(str(np.float32(key("attention.layer_norm_rms_epsilon", 1e-5)))),
        "rope_theta": theta,
        "rope_scaling": rope,
        # llama.cpp writes output.weight only when it differs from the embedding
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "use_sliding_window": False,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": list(eos) or None,
    }
    if not cfg["vocab_size"]:
        raise ModelLoadError(f"{where}: the GGUF metadata gives no vocabulary size")
    try:
        return model_config_from_hf(cfg)
    except ModelLoadError:
        raise
    except ValueError as e:
        raise ModelLoadError(f"{where}: {e}") from None

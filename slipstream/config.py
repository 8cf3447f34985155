"""Frozen configuration dataclasses.

Each component receives only its own sub-config; `EngineConfig` bundles them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency-dependent RoPE scaling ("rope_type": "llama3")."""
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder (Llama 2/3, Qwen2, Mistral, SmolLM2)."""
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False      # q/k/v projections carry a bias (Qwen2)
    sliding_window: int | None = None  # Mistral-style local attention window
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelConfig":
        """Build from a Hugging Face `config.json` dict; raise ModelLoadError when
        it is unsupported or incomplete."""
        from slipstream.errors import ModelLoadError
        try:
            return cls._from_hf_config(cfg)
        except KeyError as e:
            raise ModelLoadError(f"the model config lacks the required key {e.args[0]!r}") from None

    @classmethod
    def _from_hf_config(cls, cfg: dict) -> "ModelConfig":
        from slipstream.errors import ModelLoadError
        from slipstream.models.registry import resolve_architecture
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
        return cls(
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


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # Fraction of free accelerator memory the KV pool may take (CUDA).
    gpu_memory_utilization: float = 0.90
    # Bytes for the KV pool on the CPU (None: a default sized from the model).
    cpu_kv_cache_bytes: int | None = None
    num_blocks: int | None = None       # overrides the memory-based sizing
    enable_prefix_caching: bool = True


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048   # token budget per step
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1


@dataclass(frozen=True)
class EngineConfig:
    model: str
    model_config: ModelConfig
    dtype: torch.dtype
    device: torch.device
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    attention_backend: str | None = None   # None: the device's default
    seed: int = 0


_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: CUDA was asked for but torch sees no CUDA device")
    return dev


def _cpu_has_bf16() -> bool:
    """Whether the CPU multiplies bf16 natively (AVX512-BF16 or AMX)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = line.split()
                    return "avx512_bf16" in flags or "amx_bf16" in flags
    except OSError:
        pass
    return False


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """`auto` is bf16 on CUDA, and on CPUs with native bf16 arithmetic, where a
    bf16 GEMV reads half the bytes of fp32 and decodes about twice as fast
    (benchmarks/cpu); fp32 on other CPUs."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype: unsupported {dtype}")
        return dtype
    if dtype is None or dtype == "auto":
        if device.type == "cpu" and not _cpu_has_bf16():
            return torch.float32
        return torch.bfloat16
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"dtype: unknown {dtype!r}; choose from auto, {', '.join(_DTYPES)}") from None

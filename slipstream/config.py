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


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # Fraction of free accelerator memory the KV pool may take (CUDA).
    gpu_memory_utilization: float = 0.90
    # Bytes for the KV pool on the CPU (None: a default sized from the model).
    cpu_kv_cache_bytes: int | None = None
    num_blocks: int | None = None       # overrides the memory-based sizing
    enable_prefix_caching: bool = True
    # "auto" (the model dtype), "int8" or "fp8": codes + a scale per token and head
    kv_cache_dtype: str = "auto"


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048   # token budget per step
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding (spec/). method None: off."""
    method: str | None = None            # draft | ngram | medusa | eagle | peagle
    num_speculative_tokens: int = 4      # chain length; tree depth for eagle
    model: str | None = None             # draft model, or a Medusa / EAGLE head file
    draft_num_layers: int | None = None  # draft = the first N layers of `model` (early exit)
    draft_num_blocks: int = 1024         # the draft model's own KV pool
    ngram_max: int = 4
    ngram_min: int = 1
    medusa_topk: tuple[int, ...] | None = None   # None: (3, 2, 1, ...) over the head file's heads
    eagle_topk: int = 4
    eagle_beam: int = 4
    eagle_max_nodes: int = 16
    auto_off: bool = True                # skip drafting when the roofline predicts no gain
    draft_graphs: bool = False           # EAGLE: tree expansion from a CUDA graph (GPU)
    device_loop: bool = False            # EAGLE: spec/loop_path.py for single greedy prompts
    loop_compile: bool = False           # the loop's expansion and round parts compiled
    online: bool = False                 # EAGLE / P-EAGLE: keep training the head (spec/online.py)
    draft_min_prob: float = 0.0          # EAGLE: drafts below this path probability not verified
    online_lr: float = 1e-4
    online_every: int = 2048             # recorded pairs between updates

    @property
    def enabled(self) -> bool:
        return self.method is not None


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
    quantization: str | None = None        # a scheme of quant/ (None: dense weights)
    enforce_eager: bool = False            # no CUDA graphs
    async_scheduling: bool | None = None   # overlap host and device; None: on for CUDA
    speculative: SpecConfig = field(default_factory=SpecConfig)
    seed: int = 0


_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device: expected auto, cpu, cuda or cuda:N, got {device!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device: expected auto, cpu, cuda or cuda:N, got {device!r}")
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

"""What the analysis layer says a step of the engine could take at best.

A step of the engine mixes requests with different contexts; the analysis
layer's `Workload` is uniform (batch x new tokens, each after the same past).
A step is mapped onto it with the same totals: batch = its requests, new
tokens per request = its tokens / requests (rounded up), past = its cached
context / requests. The weights are read once per step whatever the batch,
so the bytes are exact for decode steps and close for mixed ones.
"""
from __future__ import annotations

from slipstream.analysis.flops import Precisions, Workload, model_cost
from slipstream.analysis.precision import Precision, parse_precision
from slipstream.analysis.hardware import HardwareProfile
from slipstream.analysis.model_spec import ModelSpec
from slipstream.analysis.roofline import step_bound
from slipstream.engine.stats import StepStats


# What the built-in quantization schemes store a weight in (bytes counted exactly: the
# int4 scheme keeps an fp32 scale and a uint8 zero a group of 128; per-channel scales are
# negligible): weight precision, LM head precision (None: the model dtype).
_SCHEMES = {"rtn-int4": (Precision("int4", 4, 128, scale_bits=40), None),
            "rtn-int4-head8": (Precision("int4", 4, 128, scale_bits=40), Precision("int8", 8)),
            "int8": (Precision("int8", 8), None),
            "int8-head8": (Precision("int8", 8), Precision("int8", 8)), "w8a8": (Precision("int8", 8), None),
            "fp8": (Precision("fp8", 8), None)}


def precisions_for(dtype, quantization: str | None = None, kv_cache_dtype: str = "auto",
                   head_dim: int | None = None) -> Precisions | None:
    """The precisions a step of the engine reads its weights and KV cache in; None for
    formats the analysis does not model (GGUF blocks, checkpoints' own formats, 3 bits,
    KIVI)."""
    name = {"torch.float32": "fp32", "torch.float16": "fp16"}.get(str(dtype), "bf16")
    act = parse_precision(name)
    weight, head = act, None
    if quantization is not None:
        if quantization not in _SCHEMES:
            return None
        weight, head = _SCHEMES[quantization]
    kv = act
    if kv_cache_dtype in ("int8", "fp8"):      # 1-byte codes and an fp32 scale a token and head
        kv = Precision(kv_cache_dtype, 8, head_dim, scale_bits=32) if head_dim else \
            Precision(kv_cache_dtype, 8)
    elif kv_cache_dtype not in ("auto", None, name, str(dtype).replace("torch.", "")):
        return None
    return Precisions(weight, kv, act, head)


def workload_of(s: StepStats) -> Workload:
    b = max(1, s.num_seqs)
    return Workload(batch=b, new_tokens=max(1, -(-s.num_tokens // b)),
                    past_tokens=s.context_tokens // b)


def step_bytes(spec: ModelSpec, s: StepStats, prec: Precisions) -> float:
    """Bytes one step must move at least: weights, KV read and written, activations."""
    return model_cost(spec, workload_of(s), prec).total().bytes


def step_time_bound(spec: ModelSpec, hw: HardwareProfile, s: StepStats, prec: Precisions,
                    compute_dtype: str = "bf16") -> float:
    """Least seconds for the step on `hw` (its bytes at the bandwidth or its FLOPs at the peak)."""
    return step_bound(spec, hw, workload_of(s), prec, compute_dtype).whole.time

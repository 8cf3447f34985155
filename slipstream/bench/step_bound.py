"""What the analysis layer says a step of the engine could take at best.

A step of the engine mixes requests with different contexts; the analysis
layer's `Workload` is uniform (batch x new tokens, each after the same past).
A step is mapped onto it with the same totals: batch = its requests, new
tokens per request = its tokens / requests (rounded up), past = its cached
context / requests. The weights are read once per step whatever the batch,
so the bytes are exact for decode steps and close for mixed ones.
"""
from __future__ import annotations

import torch

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
                   head_dim: int | None = None, model=None) -> Precisions | None:
    """The precisions a step of the engine reads its weights and KV cache in; None for
    formats the analysis does not model (checkpoints' own formats, 3 bits, KIVI).
    GGUF blocks are read off the loaded `model` (None there: not modelled)."""
    name = {"torch.float32": "fp32", "torch.float16": "fp16"}.get(str(dtype), "bf16")
    act = parse_precision(name)
    weight, head, head_when_tied = act, None, False
    if quantization == "gguf":
        if model is None or (stored := gguf_precisions(model)) is None:
            return None
        (weight, head), head_when_tied = stored, True
    elif quantization is not None:
        if quantization not in _SCHEMES:
            return None
        weight, head = _SCHEMES[quantization]
    kv = act
    if kv_cache_dtype in ("int8", "fp8"):      # 1-byte codes and an fp32 scale a token and head
        kv = Precision(kv_cache_dtype, 8, head_dim, scale_bits=32) if head_dim else \
            Precision(kv_cache_dtype, 8)
    elif kv_cache_dtype not in ("auto", None, name, str(dtype).replace("torch.", "")):
        return None
    return Precisions(weight, kv, act, head, head_when_tied)


def gguf_precisions(model) -> tuple[Precision, Precision | None] | None:
    """(the blocks' linear layers, the LM head) as the bytes a weight takes in
    the loaded model, averaged over its tensors (a file may mix block formats;
    Q4_1 is 5 bits a weight with its two fp16 numbers a block of 32); None when
    no layer keeps GGUF blocks. The head is the embedding table when tied."""
    body, head = [0, 0], None
    for name, module in model.named_modules():
        w = getattr(module, "gguf_weight", None)
        if w is None:
            continue
        if isinstance(w, torch.Tensor):
            size = (w.numel() * w.element_size(), w.numel())
        else:                                   # QuantMatrix: the file's blocks
            size = (sum(d.numel() for _, d in w.segments), w.rows * w.cols)
        if name.endswith(("lm_head", "embed_tokens")):
            if head is None or name.endswith("lm_head"):
                head = size
        else:
            body[0] += size[0]
            body[1] += size[1]
    if not body[1]:
        return None
    as_bits = lambda nbytes, n: Precision("gguf", 8 * nbytes / n)   # noqa: E731
    return as_bits(*body), (as_bits(*head) if head else None)


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

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
from slipstream.analysis.hardware import HardwareProfile
from slipstream.analysis.model_spec import ModelSpec
from slipstream.analysis.roofline import step_bound
from slipstream.engine.stats import StepStats


def precisions_for(dtype) -> Precisions:
    name = {"torch.float32": "fp32", "torch.float16": "fp16"}.get(str(dtype), "bf16")
    return Precisions.parse(name, name, name)


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

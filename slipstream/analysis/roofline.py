"""Roofline bounds: attainable rate = min(bandwidth x intensity, peak).

An op whose intensity (FLOPs per byte) is below the device's critical
intensity is memory-bound and takes bytes / bandwidth at best; above it, it is
compute-bound and takes FLOPs / peak at best.
"""
from __future__ import annotations

from dataclasses import dataclass

from slipstream.analysis.flops import ModelCost, Precisions, Workload, model_cost
from slipstream.analysis.hardware import HardwareProfile
from slipstream.analysis.model_spec import ModelSpec
from slipstream.analysis.op_cost import OpCost


@dataclass(frozen=True)
class OpBound:
    op: OpCost
    memory_time: float    # seconds to move its bytes at full bandwidth
    compute_time: float   # seconds to do its FLOPs at peak

    @property
    def time(self) -> float:
        return max(self.memory_time, self.compute_time)

    @property
    def bound(self) -> str:
        return "memory" if self.memory_time >= self.compute_time else "compute"

    @property
    def attainable_flops(self) -> float:
        return self.op.flops / self.time if self.time else 0.0


def bound_op(op: OpCost, hw: HardwareProfile, compute_dtype: str = "bf16") -> OpBound:
    return OpBound(op, op.bytes / hw.memory_bandwidth, op.flops / hw.peak_flops(compute_dtype))


@dataclass(frozen=True)
class StepBound:
    """Bounds for one forward pass of a model on a device."""
    cost: ModelCost
    hardware: HardwareProfile
    compute_dtype: str

    @property
    def whole(self) -> OpBound:
        """The step as one op: the least time any schedule, even one that
        overlaps every op's traffic with another's math, can take."""
        return bound_op(self.cost.total(), self.hardware, self.compute_dtype)

    @property
    def serial_time(self) -> float:
        """Ops one after another, each at its own roof (no overlap between ops)."""
        return sum(bound_op(op, self.hardware, self.compute_dtype).time for op in self.cost.ops())

    def ops(self) -> list[OpBound]:
        return [bound_op(op, self.hardware, self.compute_dtype) for op in self.cost.by_name()]

    @property
    def tokens_per_s(self) -> float:
        """Upper bound on tokens produced (decode) or consumed (prefill) per second."""
        return self.cost.workload.tokens / self.whole.time


def step_bound(spec: ModelSpec, hw: HardwareProfile, work: Workload,
               prec: Precisions = Precisions(), compute_dtype: str = "bf16") -> StepBound:
    return StepBound(model_cost(spec, work, prec), hw, compute_dtype)


def decode_bound(spec: ModelSpec, hw: HardwareProfile, batch: int = 1, context: int = 1,
                 prec: Precisions = Precisions(), compute_dtype: str = "bf16") -> StepBound:
    """One decode step: every sequence of the batch gains one token, so the
    step time is also the time per output token of each sequence."""
    return step_bound(spec, hw, Workload.decode(batch, context), prec, compute_dtype)


def weights_critical_batch(hw: HardwareProfile, weight_bytes_per_param: float = 2.0,
                           compute_dtype: str = "bf16") -> float:
    """Batch at which a decode GEMM (2 FLOPs per weight per token, each weight
    read once per step) turns compute-bound: B * 2 / bytes_per_param = I_crit."""
    return hw.critical_intensity(compute_dtype) * weight_bytes_per_param / 2.0


def critical_batch_size(spec: ModelSpec, hw: HardwareProfile, context: int = 1,
                        prec: Precisions = Precisions(), compute_dtype: str = "bf16",
                        max_batch: int = 1 << 20) -> int | None:
    """Smallest decode batch whose whole step reaches the critical intensity,
    counting the KV cache each sequence reads; None when the KV traffic keeps
    the step memory-bound at any batch up to max_batch. Intensity grows with B
    (weights are shared; for MoE, touched experts grow slower than B), so
    bisection finds the threshold."""
    target = hw.critical_intensity(compute_dtype)

    def reaches(batch: int) -> bool:
        return model_cost(spec, Workload.decode(batch, context), prec).total().intensity >= target

    if not reaches(max_batch):
        return None
    lo, hi = 0, 1
    while not reaches(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if reaches(mid) else (mid, hi)
    return hi


@dataclass(frozen=True)
class PhaseRow:
    name: str
    prefill: OpBound | None
    decode: OpBound | None


def phase_table(spec: ModelSpec, hw: HardwareProfile, prompt: int, batch: int, context: int,
                prec: Precisions = Precisions(), compute_dtype: str = "bf16") -> list[PhaseRow]:
    """Section 1.3/1.5's prefill-vs-decode table, computed: each op's intensity
    and bound when prefilling `prompt` tokens and when decoding at (batch, context)."""
    pre = {b.op.name: b for b in step_bound(spec, hw, Workload.prefill(prompt), prec,
                                            compute_dtype).ops()}
    dec = {b.op.name: b for b in decode_bound(spec, hw, batch, context, prec, compute_dtype).ops()}
    names = list(pre) + [n for n in dec if n not in pre]
    return [PhaseRow(n, pre.get(n), dec.get(n)) for n in names]

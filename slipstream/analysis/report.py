"""The analysis of one model on one device, as a JSON-ready dict and as text.

This is what `slipstream analyze MODEL` prints, and what benchmarks attach to
their results to say how close a measurement came to the bound.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from slipstream.analysis.attention_cost import span
from slipstream.analysis.flops import Precisions, Workload, count_params
from slipstream.analysis.hardware import HardwareProfile
from slipstream.analysis.model_spec import ModelSpec
from slipstream.analysis.roofline import (OpBound, critical_batch_size, phase_table, step_bound,
                                          weights_critical_batch)


@dataclass(frozen=True)
class Scenario:
    batch: int = 1          # decode batch
    context: int = 4096     # keys each decoded token attends to
    prompt: int = 4096      # tokens of one prefill
    precisions: Precisions = Precisions()
    compute_dtype: str = "bf16"


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def op_row(b: OpBound) -> dict:
    op = b.op
    return dict(name=op.name, flops=op.flops, bytes=op.bytes, weight_bytes=op.weight_bytes,
                act_bytes=op.act_bytes, kv_bytes=op.kv_read_bytes + op.kv_write_bytes,
                intensity=_finite(op.intensity), bound=b.bound, time_s=b.time)


def kv_bytes_per_sequence(spec: ModelSpec, context: int, prec: Precisions) -> float:
    """Cache held for one sequence of `context` tokens; windowed layers keep
    only the keys they can still attend to."""
    per_token = spec.kv_elements_per_token * prec.kv.bytes_per_element
    return per_token * sum(span(context - 1, 1, spec.layer_window(i), spec.window_kind).keys_read
                           for i in range(spec.num_layers))


def analyze(spec: ModelSpec, hw: HardwareProfile, sc: Scenario = Scenario()) -> dict:
    prec, dt = sc.precisions, sc.compute_dtype
    params = count_params(spec)
    decode = step_bound(spec, hw, Workload.decode(sc.batch, sc.context), prec, dt)
    prefill = step_bound(spec, hw, Workload.prefill(sc.prompt), prec, dt)
    dec_total = decode.cost.total()
    weight_bytes = dec_total.stored_bytes
    kv_seq = kv_bytes_per_sequence(spec, sc.context, prec)
    return {
        "model": spec.name, "gpu": hw.name, "gpu_source": hw.source,
        "batch": sc.batch, "context": sc.context, "prompt": sc.prompt,
        "weight_dtype": prec.weight.label, "kv_dtype": prec.kv.label, "compute_dtype": dt,
        "params": params.total,
        "active_params": params.active,
        "flops_per_token": dec_total.flops / sc.batch,
        "flops_per_token_weights": 2.0 * params.matmul_active,
        "weight_bytes": weight_bytes,
        "kv_bytes_per_token": spec.kv_elements_per_token * spec.num_layers
        * prec.kv.bytes_per_element,
        "kv_bytes_per_sequence": kv_seq,
        "memory_needed_bytes": weight_bytes + sc.batch * kv_seq,
        "gpu_memory_bytes": hw.memory_bytes,
        # Capacity alone (no activation workspace, no parallelism overhead).
        "fits_in_memory": None if hw.memory_bytes is None
        else weight_bytes + sc.batch * kv_seq <= hw.memory_bytes,
        "critical_intensity": hw.critical_intensity(dt),
        "critical_batch_size": critical_batch_size(spec, hw, sc.context, prec, dt),
        "critical_batch_size_weights": weights_critical_batch(
            hw, prec.weight.bytes_per_element, dt),
        "decode_intensity": _finite(dec_total.intensity),
        "decode_bound": decode.whole.bound,
        "decode_step_time_s": decode.whole.time,
        "decode_step_time_serial_s": decode.serial_time,
        "decode_tokens_per_s_bound": decode.tokens_per_s,
        "decode_tokens_per_s_per_sequence_bound": 1.0 / decode.whole.time,
        "prefill_time_s": prefill.whole.time,
        "prefill_tokens_per_s_bound": prefill.tokens_per_s,
        "ops": [op_row(b) for b in decode.ops()],
        "prefill_ops": [op_row(b) for b in prefill.ops()],
    }


def _si(x: float | None, unit: str = "") -> str:
    if x is None:
        return "-"
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}".rstrip()


def render_text(spec: ModelSpec, hw: HardwareProfile, sc: Scenario, data: dict) -> str:
    d = data
    crit = d["critical_batch_size"]
    lines = [
        f"{d['model']} on {d['gpu']} ({d['gpu_source']}); weights {d['weight_dtype']}, "
        f"KV {d['kv_dtype']}, compute {d['compute_dtype']}",
        f"  parameters        {_si(d['params'])} total, {_si(d['active_params'])} active per token",
        f"  FLOPs per token   {_si(d['flops_per_token'], 'FLOP')} at context {d['context']} "
        f"({_si(d['flops_per_token_weights'], 'FLOP')} = 2 x active matmul weights)",
        f"  weights           {_si(d['weight_bytes'], 'B')}; KV cache {_si(d['kv_bytes_per_token'], 'B')}"
        f"/token, {_si(d['kv_bytes_per_sequence'], 'B')}/sequence at {d['context']}",
        f"  memory needed     {_si(d['memory_needed_bytes'], 'B')} at batch {d['batch']} "
        f"(device has {_si(d['gpu_memory_bytes'], 'B')})"
        + ("" if d["fits_in_memory"] is not False else
           f": does not fit; try --num-gpus {math.ceil(d['memory_needed_bytes'] / d['gpu_memory_bytes'])}"
           " or a smaller --weight-dtype"),
        f"  critical intensity {d['critical_intensity']:.0f} FLOP/B; critical batch "
        f"{crit if crit is not None else 'never (KV-bound)'} at context {d['context']}, "
        f"{d['critical_batch_size_weights']:.0f} for the weight GEMMs alone",
        f"  decode  B={d['batch']} L={d['context']}: {d['decode_step_time_s'] * 1e3:.3f} ms/step "
        f"({d['decode_bound']}-bound, {d['decode_step_time_serial_s'] * 1e3:.3f} ms op by op) -> "
        f"<= {d['decode_tokens_per_s_bound']:.1f} tok/s, "
        f"<= {d['decode_tokens_per_s_per_sequence_bound']:.1f} tok/s per sequence",
        f"  prefill N={d['prompt']}: >= {d['prefill_time_s'] * 1e3:.2f} ms "
        f"-> <= {d['prefill_tokens_per_s_bound']:.0f} tok/s",
        "",
        f"  {'op':22s} {'prefill FLOPs':>13s} {'bytes':>9s} {'FLOP/B':>8s} {'bound':>8s}"
        f"   {'decode FLOPs':>12s} {'bytes':>9s} {'FLOP/B':>8s} {'bound':>8s}",
    ]
    for row in phase_table(spec, hw, sc.prompt, sc.batch, sc.context, sc.precisions,
                           sc.compute_dtype):
        cells = []
        for b in (row.prefill, row.decode):
            if b is None:
                cells.append(f"{'-':>13s} {'':>9s} {'':>8s} {'':>8s}")
            else:
                cells.append(f"{_si(b.op.flops):>13s} {_si(b.op.bytes):>9s} "
                             f"{b.op.intensity:8.1f} {b.bound:>8s}")
        lines.append(f"  {row.name:22s} {cells[0]}   {cells[1]}")
    return "\n".join(lines)

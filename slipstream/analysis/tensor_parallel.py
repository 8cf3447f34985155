"""Tensor parallelism's communication, and when splitting a model over N GPUs pays.

Split over N ranks (slipstream's layout: layers/linear.py, layers/embedding.py),
each rank reads 1/N of every layer's weights and does 1/N of its FLOPs: the
roofline of `HardwareProfile.times(N)`. In exchange, collectives sit on the
critical path of every step:
  * 2 all-reduces per layer (after o_proj and after down_proj), each of the
    step's [tokens, hidden] activations: 2 * hidden * act_bytes per layer per token;
  * 1 all-reduce of the vocabulary-parallel embedding output ([tokens, hidden]);
  * 1 all-gather of the logits ([logit_rows, vocab], fp32);
  * 1 broadcast of the sampled ids (a few bytes: counted as one call's latency).
Cost of one collective (alpha-beta model): latency + traffic / bus_bandwidth,
where a ring all-reduce of S bytes sends 2 (N-1)/N S bytes over each link and
an all-gather (N-1)/N of the gathered bytes; `bus_bandwidth` is NCCL's "bus
bandwidth" of a large all-reduce, `latency` the time of a small one. The step
time is the per-rank roofline plus the collectives (they do not overlap the
compute they feed), so TP pays when the saved weight reads exceed the latency
of 2 * layers + 3 collectives: rarely at small models and small batches.
"""
from __future__ import annotations

from dataclasses import dataclass

from slipstream.analysis.flops import Precisions, Workload
from slipstream.analysis.hardware import HardwareProfile
from slipstream.analysis.model_spec import ModelSpec
from slipstream.analysis.roofline import step_bound


@dataclass(frozen=True)
class Interconnect:
    name: str
    bus_bandwidth: float   # bytes/s: NCCL bus bandwidth of a large all-reduce
    latency: float         # seconds: one small all-reduce (the per-call floor)
    source: str


# Figures measured on two H200s of one host (NV18 NVLink, NCCL 2.28, NVLink
# multicast off) as quoted in the project's tensor-parallel issue: 8 KiB
# all-reduce 27.7 us eager, 17.7 us inside a CUDA graph; 64 MiB in 249 us.
# They hold for 2 ranks; for more, pass a measured bandwidth and latency.
LINKS: dict[str, Interconnect] = {
    "h200-nvlink": Interconnect("2x H200 NVLink, NCCL, eager", 270e9, 27.7e-6,
                                "measured on nvidia-h200-x2 (NCCL 2.28)"),
    "h200-nvlink-graph": Interconnect("2x H200 NVLink, NCCL in a CUDA graph", 270e9, 17.7e-6,
                                      "measured on nvidia-h200-x2 (NCCL 2.28)"),
}


def pick_link(presets: dict[str, Interconnect], default: str, name: str | None = None,
              bandwidth: float | None = None, latency: float | None = None) -> Interconnect:
    """A preset of `presets` (`default` when no name), or a custom link (bandwidth in
    bytes/s, latency in s)."""
    if bandwidth is not None or latency is not None:
        if not bandwidth or bandwidth <= 0 or latency is None or latency < 0:
            raise ValueError("a custom link needs a positive bandwidth and a latency >= 0")
        return Interconnect(f"custom ({bandwidth / 1e9:g} GB/s, {latency * 1e6:g} us)",
                            bandwidth, latency, "given")
    key = (name or default).lower()
    if key not in presets:
        raise ValueError(f"unknown link {name!r}: use one of {', '.join(presets)} or give "
                         "a bandwidth and a latency")
    return presets[key]


def get_link(name: str | None = None, bandwidth: float | None = None,
             latency: float | None = None) -> Interconnect:
    """A preset of LINKS (collectives), or a custom link."""
    return pick_link(LINKS, "h200-nvlink-graph", name, bandwidth, latency)


def all_reduce_time(nbytes: float, n: int, link: Interconnect) -> float:
    """Seconds for a ring all-reduce of `nbytes` (each rank's buffer) over n ranks."""
    if n == 1:
        return 0.0
    return link.latency + 2 * (n - 1) / n * nbytes / link.bus_bandwidth


def all_gather_time(nbytes: float, n: int, link: Interconnect) -> float:
    """Seconds for an all-gather whose result is `nbytes` on every rank."""
    if n == 1:
        return 0.0
    return link.latency + (n - 1) / n * nbytes / link.bus_bandwidth


@dataclass(frozen=True)
class TPCost:
    tp: int
    tokens: int                         # tokens of the step
    all_reduces: int                    # per step
    bytes_per_layer_per_token: float    # all-reduced activation bytes (both all-reduces)
    all_reduce_time: float              # seconds per step, all all-reduces
    logits_gather_time: float
    compute_time: float                 # per-rank roofline of the step (communication ignored)
    single_time: float                  # the same step on one device

    broadcast_time: float               # the sampled ids: one call's latency

    @property
    def comm_time(self) -> float:
        return self.all_reduce_time + self.logits_gather_time + self.broadcast_time

    @property
    def step_time(self) -> float:
        return self.compute_time + self.comm_time

    @property
    def speedup(self) -> float:
        """Over one device: TP pays when this exceeds 1."""
        return self.single_time / self.step_time

    @property
    def comm_fraction(self) -> float:
        return self.comm_time / self.step_time if self.step_time else 0.0


def tp_cost(spec: ModelSpec, hw: HardwareProfile, link: Interconnect, tp: int, work: Workload,
            prec: Precisions = Precisions(), compute_dtype: str = "bf16") -> TPCost:
    """The cost of one step of `work` at tensor-parallel size `tp` (hw: one device)."""
    if tp < 1:
        raise ValueError(f"tensor-parallel size must be at least 1, got {tp}")
    act = prec.act.bytes_per_element
    per_call = work.tokens * spec.hidden_size * act          # one [tokens, hidden] all-reduce
    calls = 2 * spec.num_layers + 1 if tp > 1 else 0
    single = step_bound(spec, hw, work, prec, compute_dtype).whole.time
    compute = step_bound(spec, hw.times(tp), work, prec, compute_dtype).whole.time
    return TPCost(
        tp=tp, tokens=work.tokens, all_reduces=calls,
        bytes_per_layer_per_token=2 * spec.hidden_size * act,
        all_reduce_time=calls * all_reduce_time(per_call, tp, link),
        logits_gather_time=all_gather_time(work.logit_rows * spec.vocab_size * 4, tp, link),
        compute_time=compute, single_time=single,
        broadcast_time=link.latency if tp > 1 else 0.0)


def tp_rows(spec: ModelSpec, hw: HardwareProfile, link: Interconnect, sizes: list[int],
            work: Workload, prec: Precisions = Precisions(),
            compute_dtype: str = "bf16") -> list[dict]:
    """One JSON-ready row per tensor-parallel size."""
    rows = []
    for n in sizes:
        c = tp_cost(spec, hw, link, n, work, prec, compute_dtype)
        rows.append(dict(tp=n, tokens=c.tokens, all_reduces_per_step=c.all_reduces,
                         all_reduce_bytes_per_layer_per_token=c.bytes_per_layer_per_token,
                         comm_time_s=c.comm_time, compute_time_s=c.compute_time,
                         step_time_s=c.step_time, speedup=c.speedup,
                         comm_fraction=c.comm_fraction, pays=c.speedup > 1.0))
    return rows


def render_tp(spec: ModelSpec, hw: HardwareProfile, link: Interconnect, phase: str,
              rows: list[dict]) -> str:
    lines = [f"{spec.name} on {hw.name} ({phase}), link: {link.name} "
             f"[{link.bus_bandwidth / 1e9:g} GB/s bus, {link.latency * 1e6:g} us per call; "
             f"{link.source}]",
             f"{'TP':>3} {'all-reduces':>11} {'B/layer/token':>13} {'comm':>10} {'compute':>10} "
             f"{'step':>10} {'speedup':>8} {'comm %':>7}  pays"]
    for r in rows:
        lines.append(f"{r['tp']:>3} {r['all_reduces_per_step']:>11} "
                     f"{r['all_reduce_bytes_per_layer_per_token']:>13.0f} "
                     f"{r['comm_time_s'] * 1e3:>8.3f}ms {r['compute_time_s'] * 1e3:>8.3f}ms "
                     f"{r['step_time_s'] * 1e3:>8.3f}ms {r['speedup']:>7.2f}x "
                     f"{r['comm_fraction'] * 100:>6.1f}%  "
                     f"{'-' if r['tp'] == 1 else 'yes' if r['pays'] else 'no'}")
    return "\n".join(lines)

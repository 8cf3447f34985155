"""A profile of the same steps on every tensor-parallel rank.

`RankProfiler` wraps torch.profiler around a window of steps on one rank and
writes, under a directory, that rank's kernel table (name, launches, total
and per-step device time, share of the window's wall time) as JSON and
Markdown, and optionally a Chrome trace. Rank 0 drives the window: its
executor sends a `ProfileCommand` to the workers in place of a step (see
worker.py), so every rank profiles the steps rank 0 profiles.

On a CPU-only run (gloo) the table lists operators by self CPU time instead of
kernels by device time.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class ProfileCommand:
    """Sent to the workers in place of a step. op: "start" or "stop".
    On stop: write under `out_dir` files named `{tag}_rank{r}_*`; `steps`: how
    many steps the window held (per-step figures); `trace`: also a Chrome trace;
    `cpu`: (on start) record host activity too (larger traces, some overhead)."""
    op: str
    out_dir: str = ""
    tag: str = "profile"
    steps: int = 1
    trace: bool = False
    cpu: bool = False


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _busy_us(events) -> float:
    """Length of the union of the device events' intervals (us)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events)
    busy, end = 0.0, float("-inf")
    for s, e in spans:
        if e <= end:
            continue
        busy += e - max(s, end)
        end = e
    return busy


def is_collective(name: str) -> bool:
    n = name.lower()
    return any(k in n for k in ("nccl", "allreduce", "all_reduce", "symm", "multimem",
                                "gloo", "c10d"))


class RankProfiler:
    def __init__(self, rank: int, device: torch.device):
        self.rank, self.device = rank, device
        self._prof = None
        self._t0 = 0.0
        self._wait = 0.0

    def resolve(self, runner, handle):
        """runner.resolve(handle), timing the wait inside a window: a rank whose host
        keeps ahead of its GPU waits most of each step there; one that waits ~0 is
        bound by its host (the GPU then idles between steps)."""
        t = time.perf_counter()
        out = runner.resolve(handle)
        if self._prof is not None:
            self._wait += time.perf_counter() - t
        return out

    def start(self, cmd: ProfileCommand | None = None) -> None:
        from torch.profiler import ProfilerActivity, profile
        if self._prof is not None:
            raise RuntimeError("a profile window is already open on this rank")
        acts = []
        if self.device.type == "cuda":
            acts.append(ProfilerActivity.CUDA)
        if self.device.type != "cuda" or (cmd is not None and cmd.cpu):
            acts.append(ProfilerActivity.CPU)
        _sync(self.device)
        self._wait = 0.0
        self._prof = profile(activities=acts)
        self._prof.__enter__()
        self._t0 = time.perf_counter()

    def stop(self, cmd: ProfileCommand) -> dict:
        """Close the window, write this rank's files, return its summary."""
        if self._prof is None:
            raise RuntimeError("no profile window is open on this rank")
        _sync(self.device)
        wall_us = (time.perf_counter() - self._t0) * 1e6
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        steps = max(cmd.steps, 1)
        table = kernel_table(prof, self.device)
        gpu = self.device.type == "cuda"
        busy = _busy_us([e for e in prof.events() if _on_device(e)]) if gpu else None
        for r in table:
            r["us_per_step"] = r["total_us"] / steps
            r["count_per_step"] = r["count"] / steps
            r["pct_of_step"] = 100 * r["total_us"] / wall_us
        summary = {
            "rank": self.rank, "tag": cmd.tag, "steps": steps, "device": str(self.device),
            "time": "device (kernels)" if gpu else "self CPU (operators)",
            "wall_ms_per_step": wall_us / steps / 1e3,
            "resolve_wait_ms_per_step": self._wait / steps * 1e3,
            "kernel_ms_per_step": sum(r["total_us"] for r in table) / steps / 1e3,
            "busy_ms_per_step": busy / steps / 1e3 if busy is not None else None,
            "collective_ms_per_step": sum(r["total_us"] for r in table
                                          if is_collective(r["name"])) / steps / 1e3,
            "launches_per_step": sum(r["count"] for r in table) / steps,
            "kernels": table}
        out = Path(cmd.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        stem = out / f"{cmd.tag}_rank{self.rank}"
        Path(f"{stem}_kernels.json").write_text(json.dumps(summary, indent=1) + "\n")
        Path(f"{stem}_kernels.md").write_text(markdown(summary))
        if cmd.trace:
            prof.export_chrome_trace(f"{stem}_trace.json")
        return summary


def _on_device(e) -> bool:
    from torch.autograd import DeviceType
    return e.device_type == DeviceType.CUDA


def kernel_table(prof, device: torch.device) -> list[dict]:
    """Rows {name, count, total_us}, largest total first: the device's kernels (and
    copies) on a GPU, counted once even where host operators were recorded too
    (their device time would count the same kernels again); operators on the CPU."""
    acc: dict[str, list] = {}
    if device.type == "cuda":
        for e in prof.events():
            if _on_device(e):
                row = acc.setdefault(e.name[:200], [0, 0.0])
                row[0] += 1
                row[1] += e.time_range.end - e.time_range.start
    else:
        for e in prof.key_averages():
            if e.self_cpu_time_total > 0:
                acc[e.key[:200]] = [int(e.count), float(e.self_cpu_time_total)]
    rows = [{"name": k, "count": c, "total_us": float(t)} for k, (c, t) in acc.items() if t > 0]
    rows.sort(key=lambda r: -r["total_us"])
    return rows


def markdown(s: dict, top: int = 40) -> str:
    busy = f", busy {s['busy_ms_per_step']:.3f}" if s["busy_ms_per_step"] is not None else ""
    lines = [f"# {s['tag']}, rank {s['rank']} ({s['device']}), {s['steps']} steps",
             "", f"Per step: wall {s['wall_ms_per_step']:.3f} ms (host waiting for the GPU "
             f"{s['resolve_wait_ms_per_step']:.3f}), {s['time']} "
             f"{s['kernel_ms_per_step']:.3f} ms{busy}, collectives "
             f"{s['collective_ms_per_step']:.3f} ms, {s['launches_per_step']:.0f} launches", "",
             "| name | count/step | us/step | mean us | % of step |", "|---|---:|---:|---:|---:|"]
    for r in s["kernels"][:top]:
        lines.append(f"| `{r['name'][:110]}` | {r['count_per_step']:.1f} | {r['us_per_step']:.1f} "
                     f"| {r['total_us'] / max(r['count'], 1):.2f} | {r['pct_of_step']:.1f} |")
    return "\n".join(lines) + "\n"

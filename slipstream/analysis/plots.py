"""Roofline chart: the device's two roofs with a model's ops placed on them."""
from __future__ import annotations

from pathlib import Path

from slipstream.analysis.hardware import HardwareProfile
from slipstream.analysis.roofline import OpBound

_PHASE_STYLE = {"prefill": dict(marker="o", color="tab:blue"),
                "decode": dict(marker="s", color="tab:red")}


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ValueError("plotting needs matplotlib: pip install 'slipstream[plot]'") from None
    matplotlib.use("Agg")   # files only; never open a window
    import matplotlib.pyplot as plt
    return plt


def plot_roofline(hw: HardwareProfile, phases: dict[str, list[OpBound]], path: str | Path,
                  title: str = "", compute_dtype: str = "bf16") -> Path:
    """Write a log-log roofline to `path` (.png or .svg, by suffix). `phases`
    maps a label ("prefill", "decode") to the op bounds to place; ops that do
    no FLOPs (embedding lookup) have no place on a log axis and are skipped."""
    plt = _pyplot()
    peak, bw = hw.peak_flops(compute_dtype), hw.memory_bandwidth
    ridge = peak / bw
    points = [(label, b) for label, bounds in phases.items() for b in bounds
              if b.op.flops > 0 and b.op.bytes > 0]
    lo = min([b.op.intensity for _, b in points] + [ridge]) / 4
    hi = max([b.op.intensity for _, b in points] + [ridge]) * 4

    fig, ax = plt.subplots(figsize=(9, 6))
    ax.loglog([lo, ridge, hi], [bw * lo, peak, peak], color="black", lw=2,
              label=f"{hw.name} roof ({bw / 1e12:.2f} TB/s, {peak / 1e12:.0f} TFLOP/s {compute_dtype})")
    ax.axvline(ridge, color="gray", ls=":", lw=1)
    ax.annotate(f"critical intensity {ridge:.0f}", (ridge, peak / 30), textcoords="offset points",
                xytext=(5, 0), fontsize=8, color="gray")
    key_lines = []
    for label in phases:
        mine = sorted((b for lab, b in points if lab == label), key=lambda b: b.op.intensity)
        if not mine:
            continue
        style = _PHASE_STYLE.get(label, dict(marker="^", color="tab:green"))
        tag = label[0].upper()
        xs = [b.op.intensity for b in mine]
        ys = [min(bw * x, peak) for x in xs]
        ax.scatter(xs, ys, s=36, zorder=3, label=label, **style)
        # Ops of near-equal intensity share one point: label them together,
        # by number, and list the numbers in a key beside the chart.
        key_lines.append(f"{label}:")
        clusters: list[list[int]] = []
        for i, x in enumerate(xs):
            if clusters and x <= xs[clusters[-1][0]] * 1.3:
                clusters[-1].append(i)
            else:
                clusters.append([i])
            b = mine[i]
            key_lines.append(f"{tag + str(i + 1):<4s}{b.op.name:<21s} {x:8.1f} {b.bound}")
        for n, members in enumerate(clusters):
            text = ",".join(f"{tag}{i + 1}" for i in members)
            ax.annotate(text, (xs[members[0]], ys[members[0]]), fontsize=7, color=style["color"],
                        textcoords="offset points", xytext=(5, 6 if n % 2 else -12))
        key_lines.append("")
    header = f"{'':<4s}{'op':<21s} {'FLOP/B':>8s} bound"
    ax.text(1.02, 1.0, header + "\n" + "\n".join(key_lines),
            transform=ax.transAxes, va="top", ha="left", family="monospace", fontsize=7)
    ax.set_xlabel("arithmetic intensity (FLOPs / byte)")
    ax.set_ylabel("attainable FLOP/s")
    ax.set_title(title or f"Roofline on {hw.name}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=150, bbox_inches="tight")
    plt.close(fig)
    return path

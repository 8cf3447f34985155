"""Summary tables of the CLI forms other than `analyze MODEL`: the GPUs, the
chapter's models, speculative decoding, and a measured profile."""
from __future__ import annotations

from typing import Callable

from slipstream.analysis import specdec
from slipstream.analysis.flops import Precisions, Workload, count_params, model_cost
from slipstream.analysis.hardware import GPUS, HardwareProfile, get_hardware
from slipstream.analysis.precision import parse_precision
from slipstream.analysis.presets import CHAPTER_CLAIMS, PRESETS, resolve_model
from slipstream.analysis.roofline import critical_batch_size, weights_critical_batch

# Section 1.4/1.6: critical intensity and "theoretical" critical batch as printed.
_CHAPTER_GPU = {"A100": (156, 78), "H100": (295, 148), "B200": (250, 125)}
_INT4 = parse_precision("int4").bytes_per_element


def gpu_rows() -> list[dict]:
    rows = []
    for name, hw in GPUS.items():
        chapter = _CHAPTER_GPU.get(name, (None, None))
        rows.append(dict(
            gpu=name, memory_bandwidth=hw.memory_bandwidth, bf16_flops=hw.bf16_flops,
            fp8_flops=hw.fp8_flops, memory_bytes=hw.memory_bytes,
            critical_intensity=hw.critical_intensity("bf16"),
            critical_batch_bf16=weights_critical_batch(hw, 2.0, "bf16"),
            critical_batch_fp8=weights_critical_batch(hw, 1.0, "fp8"),
            critical_batch_int4_w4a16=weights_critical_batch(hw, _INT4, "bf16"),
            chapter_critical_intensity=chapter[0], chapter_critical_batch=chapter[1]))
    return rows


def _grid(title: str, columns: list[tuple[str, int, Callable[[dict], str]]],
          rows: list[dict]) -> str:
    """A fixed-width table: each column is (header, width, row -> cell text);
    the first column (names) is left-aligned, the others (numbers) right."""
    def line(cells: list[str]) -> str:
        return " ".join(f"{c:{'<' if i == 0 else '>'}{w}s}"
                        for i, (c, (_, w, _)) in enumerate(zip(cells, columns)))
    return "\n".join([title, line([h for h, _, _ in columns])]
                     + [line([cell(r) for _, _, cell in columns]) for r in rows])


def _num(key: str, scale: float, fmt: str, suffix: str = "") -> Callable[[dict], str]:
    return lambda r: "-" if r[key] is None else f"{r[key] / scale:{fmt}}{suffix}"


def render_gpus(rows: list[dict]) -> str:
    return _grid("critical batch: decode GEMMs turn compute-bound (weights only; KV reads "
                 "push it higher)", [
                     ("gpu", 6, lambda r: r["gpu"]),
                     ("TB/s", 6, _num("memory_bandwidth", 1e12, ".2f")),
                     ("bf16 TF", 8, _num("bf16_flops", 1e12, ".1f")),
                     ("fp8 TF", 7, _num("fp8_flops", 1e12, ".0f")),
                     ("I_crit", 7, _num("critical_intensity", 1, ".1f")),
                     ("B bf16", 7, _num("critical_batch_bf16", 1, ".0f")),
                     ("B fp8", 6, _num("critical_batch_fp8", 1, ".0f")),
                     ("B W4A16", 8, _num("critical_batch_int4_w4a16", 1, ".0f")),
                     ("chapter I_crit", 15, _num("chapter_critical_intensity", 1, ".0f")),
                     ("chapter B", 10, _num("chapter_critical_batch", 1, ".0f")),
                 ], rows)


def model_rows() -> list[dict]:
    rows = []
    for name, spec in PRESETS.items():
        params, claim = count_params(spec), CHAPTER_CLAIMS[name]
        rows.append(dict(
            model=name, params=params.total, active_params=params.active,
            flops_per_token=model_cost(spec, Workload.decode(1, 1)).total().flops,
            kv_bytes_per_token=spec.kv_elements_per_token * spec.num_layers * 2,
            chapter_params=claim.params * 1e9, chapter_active_params=claim.active * 1e9,
            chapter_flops_per_token=claim.gflops_per_token * 1e9))
    return rows


def render_models(rows: list[dict]) -> str:
    return _grid("FLOPs/token: one decode step at context 1; KV: bf16, all layers", [
        ("model", 18, lambda r: r["model"]),
        ("params", 8, _num("params", 1e9, ".1f", "B")),
        ("active", 7, _num("active_params", 1e9, ".1f", "B")),
        ("GFLOP/tok", 9, _num("flops_per_token", 1e9, ".1f")),
        ("KV kB/tok", 9, _num("kv_bytes_per_token", 1e3, ".1f")),
        ("chapter: params", 16, _num("chapter_params", 1e9, ".0f", "B")),
        ("active", 6, _num("chapter_active_params", 1e9, ".0f", "B")),
        ("GFLOP/tok", 9, _num("chapter_flops_per_token", 1e9, ".0f")),
    ], rows)


def specdec_summary(alpha: float, gamma: int, c: float, gpu: str | None = None,
                    model: str | None = None, context: int = 1,
                    weight_dtype: str = "bf16") -> dict:
    best = specdec.best_gamma(alpha, c)
    data = dict(alpha=alpha, gamma=gamma, c=c,
                tau=specdec.expected_tokens(alpha, gamma),
                speedup=specdec.speedup(alpha, gamma, c),
                best_gamma=best, best_speedup=specdec.speedup(alpha, best, c),
                max_speedup=specdec.max_speedup(alpha))
    if gpu:
        hw = get_hardware(gpu)
        prec = Precisions.parse(weight_dtype)
        if model:
            crit = critical_batch_size(resolve_model(model), hw, context, prec)
        else:
            crit = weights_critical_batch(hw, prec.weight.bytes_per_element)
        data.update(gpu=hw.name, critical_batch=crit, breakeven_batch=None if crit is None
                    else specdec.breakeven_batch(alpha, gamma, c, crit))
    return data


def render_specdec(d: dict) -> str:
    lines = [f"alpha={d['alpha']} gamma={d['gamma']} c={d['c']}",
             f"  tau (tokens per round)  {d['tau']:.4f}",
             f"  speedup                 {d['speedup']:.4f}",
             f"  best gamma              {d['best_gamma']} (speedup {d['best_speedup']:.4f})",
             f"  limit 1/(1-alpha)       {d['max_speedup']:.4g}"]
    if "gpu" in d:
        if d["critical_batch"] is None:
            lines.append(f"  on {d['gpu']}: decode never turns compute-bound; speculation keeps paying")
        else:
            lines.append(f"  on {d['gpu']}: critical batch {d['critical_batch']:.0f}; speculation "
                         f"stops paying past batch {d['breakeven_batch']:.0f} (roofline bound)")
    return "\n".join(lines)


def measured_summary(prof: HardwareProfile, path: str) -> dict:
    data = dict(name=prof.name, memory_bandwidth=prof.memory_bandwidth,
                bf16_flops=prof.bf16_flops, critical_intensity=prof.critical_intensity(),
                source=prof.source, path=path)
    sheet = next((hw for key, hw in GPUS.items() if key in prof.name.upper()), None)
    if sheet is not None:
        data.update(datasheet=sheet.name,
                    bandwidth_fraction=prof.memory_bandwidth / sheet.memory_bandwidth,
                    flops_fraction=prof.bf16_flops / sheet.bf16_flops)
    return data


def render_measured(d: dict) -> str:
    lines = [f"{d['name']}: copy {d['memory_bandwidth'] / 1e9:.1f} GB/s, bf16 matmul "
             f"{d['bf16_flops'] / 1e12:.2f} TFLOP/s, critical intensity {d['critical_intensity']:.1f}"]
    if "datasheet" in d:
        lines.append(f"  vs {d['datasheet']} datasheet: {d['bandwidth_fraction']:.0%} of bandwidth, "
                     f"{d['flops_fraction']:.0%} of bf16 peak")
    lines.append(f"  profile saved to {d['path']} (use it with --gpu {d['path']})")
    return "\n".join(lines)

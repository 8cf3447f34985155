"""Offline quantization of a whole model, layer by layer: `slipstream quantize`.

For each decoder layer, in order: run the calibration windows through it (the layers
before it already quantized, so it sees the inputs it will see at run time), collect
its linear layers' input statistics, quantize them by the method, install the
quantized weights, and run the windows through the quantized layer to make the next
layer's inputs. The result is saved by quant/checkpoint.py. With GPTQ's asymmetric
calibration (asym_calib > 0) the windows also run through an unquantized copy of each
layer, whose inputs are the targets (gptq.py).

Methods: rtn (no calibration), gptq, awq (int4 weight-only), smoothquant (W8A8 int8),
mixed (per-layer bits under a size budget, each layer quantized by GPTQ).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from slipstream.layers.linear import LinearBase
from slipstream.quant import awq, smoothquant
from slipstream.quant.calibration import (CalibrationModel, InputRecorder, InputStats,
                                          token_windows)
from slipstream.quant.folding import fold, layer_sites
from slipstream.quant.gptq import gptq_quantize
from slipstream.quant.int_weight import IntWeightMethod, layer_group_cols, set_quantized
from slipstream.quant.rtn import rtn_quantize
from slipstream.quant.w8a8 import Int8W8A8Method, quantize_weight_int8

METHODS = ("rtn", "gptq", "awq", "smoothquant", "mixed")


@dataclass(frozen=True)
class QuantizeOptions:
    method: str = "gptq"
    bits: int = 4
    group_size: int | None = 128
    sym: bool = False
    act_order: bool = True             # GPTQ: columns by decreasing Hessian diagonal
    true_sequential: bool = True       # GPTQ: qkv, o, gate_up, down each see quantized inputs
    static_groups: bool = False        # GPTQ act-order: ranges fixed up front, no run-time perm
    damp: float = 0.01
    block_size: int = 128
    clip_grid: int = 20                # GPTQ / AWQ: range-clipping search steps (0: none)
    clip_min: float = 0.5              # GPTQ / AWQ: smallest range ratio the search tries
    clip_separate: bool = False        # GPTQ: low and high ends of a range searched apart
    # GPTQ (true-sequential): weight of GPTAQ's target W X_ref (the unquantized model's
    # inputs); 0.5 chosen on held-out calibration windows (benchmarks/quant/README.md).
    asym_calib: float = 0.5
    alpha: float | None = None         # SmoothQuant strength; None: searched per fold site
    awq_grid: int = 20
    awq_duo: bool = False              # AWQ: also try AutoAWQ's duo scaling x^a / w^(1-a)
    awq_clip_grid: int | None = None   # AWQ clipping steps (None: clip_grid // 2)
    awq_all_rows: bool = True          # AWQ searches: every calibration row (Gram matrix)
    seq_len: int = 512
    num_windows: int = 16              # 8,192 tokens: over 5x the widest layer input here
    sample_rows: int = 2048            # AWQ / SmoothQuant searches: rows spread over all windows
    avg_bits: float = 3.5              # mixed precision: average bits budget
    # 2 bits is allowed but not a default: on SmolLM2-135M, layers at 2 bits cost far more
    # perplexity than their own output error predicts (benchmarks/quant/README.md).
    mixed_bits: tuple[int, ...] = (3, 4, 8)

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method: expected one of {METHODS}, got {self.method!r}")
        if self.method in ("rtn", "gptq", "awq") and self.bits not in (2, 3, 4, 8):
            raise ValueError(f"bits: expected 2, 3, 4 or 8, got {self.bits}")
        if self.group_size is not None and self.group_size < 1:
            raise ValueError(f"group_size: expected None (per channel) or at least 1, got "
                             f"{self.group_size}")
        if not 0.0 < self.damp <= 1.0:   # GPTQ's damp_percent: H + damp * mean(diag H) I
            raise ValueError(f"damp: expected a fraction in (0, 1], got {self.damp}")
        for name, low in (("block_size", 1), ("clip_grid", 0), ("awq_grid", 1), ("seq_len", 2),
                          ("num_windows", 1), ("sample_rows", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}: expected an integer of at least {low}, got {value!r}")
        if not 0.0 < self.clip_min <= 1.0:
            raise ValueError(f"clip_min: expected a ratio in (0, 1], got {self.clip_min}")
        if self.method == "mixed":
            if not self.mixed_bits or any(b not in (2, 3, 4, 8) for b in self.mixed_bits):
                raise ValueError(f"mixed_bits: each width must be 2, 3, 4 or 8, got "
                                 f"{self.mixed_bits}")
            if not min(self.mixed_bits) <= self.avg_bits:
                raise ValueError(f"avg_bits: {self.avg_bits} is below the smallest of "
                                 f"mixed_bits {self.mixed_bits}")
        if not 0.0 <= self.asym_calib <= 1.0:
            raise ValueError(f"asym_calib: expected a value in [0, 1], got {self.asym_calib}")
        if self.alpha is not None and not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha: expected a value in [0, 1] or None, got {self.alpha}")


@dataclass
class QuantizeReport:
    layers: dict = field(default_factory=dict)      # module name -> plan entry
    info: dict = field(default_factory=dict)        # method-specific facts (alphas, allocation)


def _install_int(module: LinearBase, qt, perm, bits: int, group_size, sym: bool) -> dict:
    module.quant_method = IntWeightMethod(bits, group_size, sym, perm is not None,
                                          prequantized=True)
    device = module.weight.device
    del module.weight
    module.group_cols = qt.group_cols
    set_quantized(module, qt.codes, qt.scale, qt.zero, bits, sym, device, perm)
    return {"kind": "int", "bits": bits, "group_size": group_size, "sym": sym,
            "act_order": perm is not None}


def _install_w8a8(module: LinearBase) -> dict:
    wq, ws = quantize_weight_int8(module.weight.data.float())
    module.quant_method = Int8W8A8Method(prequantized=True)
    del module.weight
    module.register_parameter("weight", torch.nn.Parameter(wq, requires_grad=False))
    module.register_parameter("weight_scale", torch.nn.Parameter(ws, requires_grad=False))
    module.weight.output_dim = module.weight_scale.output_dim = 0
    module.quant_method.process_after_loading(module)
    return {"kind": "w8a8"}


def _awq_fold(cm: CalibrationModel, i: int, stats: dict[str, InputStats], opts, info) -> dict:
    """Search AWQ scales for each fold site of layer i and fold them; returns, per consumer
    name, the scale its calibration inputs must be divided by from now on."""
    p = f"model.layers.{i}"
    applied = {}
    for site in layer_sites(cm.layers[i]):
        st = stats[f"{p}.{site.name}"]
        group = layer_group_cols(site.consumer.input_size, opts.group_size)
        w = site.consumer.weight.data
        w_mean = site.tie_reduce(awq.weight_mean(w, group), "mean") if opts.awq_duo else None
        res = awq.search_scales(w, None if opts.awq_all_rows else st.sample, opts.bits, group,
                                opts.sym, opts.awq_grid, site.tie_reduce(st.abs_mean, "mean"),
                                w_mean, st.hessian / 2 if opts.awq_all_rows else None)
        info.setdefault("awq_alpha", {})[f"{p}.{site.name}"] = res.alpha
        if opts.awq_duo:
            info.setdefault("awq_duo", {})[f"{p}.{site.name}"] = res.duo
        fold(site, res.scales)
        applied[f"{p}.{site.name}"] = res.scales
    return applied


def _awq_clip(module: LinearBase, name: str, st: InputStats, s: torch.Tensor, opts) -> None:
    """AWQ's clipping search on the layer's weight (the q and k rows of qkv_proj are left
    alone, as in AWQ: their error reaches the output through q k^T, not linearly)."""
    w = module.weight.data
    rows = slice(0, w.shape[0])
    if name.endswith("qkv_proj"):
        rows = slice(sum(module.output_sizes[:2]), w.shape[0])
    group = layer_group_cols(module.input_size, opts.group_size)
    x = gram = None
    if opts.awq_all_rows:   # the Gram matrix of x / s
        gram = st.hessian / 2 / (s[:, None] * s[None, :])
    else:
        x = st.sample / s[None, :]
    w[rows] = awq.search_clip(w[rows], x, opts.bits, group, opts.sym,
                              grid=opts.awq_clip_grid or max(1, opts.clip_grid // 2),
                              min_ratio=opts.clip_min, gram=gram).to(w.dtype)


def _smooth(cm: CalibrationModel, i: int, stats: dict[str, InputStats], alpha, info) -> None:
    p = f"model.layers.{i}"
    for site in layer_sites(cm.layers[i]):
        st = stats[f"{p}.{site.name}"]
        w = [site.consumer.weight.data]
        if alpha is None:
            a, s, _ = smoothquant.search_alpha(st.sample, st.abs_max, w, tie=site.tie_reduce)
        else:
            a = alpha
            s = smoothquant.smooth_scales(site.tie_reduce(st.abs_max, "max"), w, alpha)
            s = site.tie_reduce(s, "max")
        info.setdefault("smoothquant_alpha", {})[f"{p}.{site.name}"] = a
        fold(site, s)


# GPTQ's true-sequential order: each group of a decoder layer is quantized from the inputs
# it receives once the groups before it are quantized.
STAGES = (("self_attn.qkv_proj",), ("self_attn.o_proj",), ("mlp.gate_up_proj",),
          ("mlp.down_proj",))


def _gptq_install(module, w, h, bits, opts, cross=None) -> dict:
    group = layer_group_cols(module.input_size, opts.group_size)
    qt, perm = gptq_quantize(w, h, bits, group, opts.sym, opts.block_size, opts.damp,
                             opts.act_order, opts.clip_grid, opts.static_groups,
                             opts.clip_min, opts.clip_separate, cross, opts.asym_calib)
    return _install_int(module, qt, perm, bits, opts.group_size, opts.sym)


def quantize_layers(cm: CalibrationModel, windows: list[list[int]], opts: QuantizeOptions,
                    bits_plan: dict[str, int] | None = None, progress=None) -> QuantizeReport:
    """Quantize every decoder layer of `cm.model` in place; returns the per-layer plan."""
    report = QuantizeReport()
    needs_data = opts.method != "rtn"
    gptq = opts.method in ("gptq", "mixed")
    states = cm.embed(windows) if needs_data else None
    asym = gptq and opts.true_sequential and opts.asym_calib > 0
    ref_states = states
    for i in range(len(cm.layers)):
        linears = cm.linear_layers(i)
        p = f"model.layers.{i}"
        bits_of = lambda name: bits_plan[name] if bits_plan else opts.bits  # noqa: E731
        if gptq and opts.true_sequential:
            if asym:   # the unquantized model's inputs of each linear layer, and next states
                rec = {n: InputRecorder() for n in linears}
                ref_states = cm.run_layer(i, ref_states, rec, layer=cm.copy_layer(i))
            for stage in STAGES:
                names = [f"{p}.{n}" for n in stage]
                stats = {n: InputStats(linears[n].input_size, hessian=True) for n in names}
                for n in names if asym else ():
                    stats[n].reference = rec.pop(n).inputs
                cm.run_layer(i, states, stats, stop_early=True)
                for n in names:
                    report.layers[n] = _gptq_install(linears[n], linears[n].weight.data.float(),
                                                     stats[n].hessian, bits_of(n), opts,
                                                     stats[n].cross)
        else:
            stats = None
            scaled = {}
            if needs_data:
                # every 4th row (neighbours are alike), sparser where that would overflow
                stride = max(4, -(-sum(len(w) for w in windows) // opts.sample_rows))
                hess = gptq or (opts.method == "awq" and opts.awq_all_rows)
                stats = {n: InputStats(m.input_size, hessian=hess, max_rows=opts.sample_rows,
                                       row_stride=stride) for n, m in linears.items()}
                cm.run_layer(i, states, stats)
            if opts.method == "awq":
                scaled = _awq_fold(cm, i, stats, opts, report.info)
            if opts.method == "smoothquant":
                _smooth(cm, i, stats, opts.alpha, report.info)
            for name, module in linears.items():
                if opts.method == "smoothquant":
                    report.layers[name] = _install_w8a8(module)
                    continue
                bits = bits_of(name)
                if gptq:
                    report.layers[name] = _gptq_install(module, module.weight.data.float(),
                                                        stats[name].hessian, bits, opts)
                    continue
                if opts.method == "awq" and opts.clip_grid > 0:
                    _awq_clip(module, name, stats[name], scaled[name], opts)
                group = layer_group_cols(module.input_size, opts.group_size)
                qt = rtn_quantize(module.weight.data.float(), bits, group, opts.sym)
                report.layers[name] = _install_int(module, qt, None, bits, opts.group_size,
                                                   opts.sym)
        if needs_data and i + 1 < len(cm.layers):
            states = cm.run_layer(i, states)
        if progress is not None:
            progress(i)
    return report


def quantize_model(files, opts: QuantizeOptions, calib_text: str, device="cpu",
                   progress=None, start=None) -> tuple[CalibrationModel, QuantizeReport]:
    """Load `files` dense, quantize it by `opts`; returns the model and its plan.
    `start(num_layers)` is called once the model is loaded (and, for mixed, its bits
    allocated), before the first layer; `progress(i)` after each decoder layer i."""
    cm = CalibrationModel(files, device)
    windows = token_windows(files.tokenizer(), calib_text, opts.seq_len, opts.num_windows)
    bits_plan = None
    info = {"calibration_windows": len(windows),
            "calibration_tokens": sum(len(w) for w in windows)}
    if opts.method == "mixed":
        from slipstream.quant.mixed_precision import plan_bits
        bits_plan, alloc = plan_bits(cm, windows, opts)
        info["allocation"] = alloc
    if start is not None:
        start(len(cm.layers))
    report = quantize_layers(cm, windows, opts, bits_plan, progress)
    report.info.update(info)
    return cm, report

"""Offline quantization of a whole model, layer by layer: `slipstream quantize`.

For each decoder layer, in order: run the calibration windows through it (the layers
before it already quantized, so it sees the inputs it will see at run time), collect
its linear layers' input statistics, quantize them by the method, install the
quantized weights, and run the windows through the quantized layer to make the next
layer's inputs. The result is saved by quant/checkpoint.py.

Methods: rtn (no calibration), gptq, awq (int4 weight-only), smoothquant (W8A8 int8),
mixed (per-layer bits under a size budget, each layer quantized by GPTQ).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from slipstream.layers.linear import LinearBase
from slipstream.quant import awq, smoothquant
from slipstream.quant.calibration import CalibrationModel, InputStats, token_windows
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
    act_order: bool = False
    damp: float = 0.01
    block_size: int = 128
    alpha: float = 0.5                 # SmoothQuant migration strength
    awq_grid: int = 20
    seq_len: int = 256
    num_windows: int = 32
    avg_bits: float = 3.5              # mixed precision: average bits budget
    # 2 bits is allowed but not a default: on SmolLM2-135M, layers at 2 bits cost far more
    # perplexity than their own output error predicts (benchmarks/quant/README.md).
    mixed_bits: tuple[int, ...] = (3, 4, 8)

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method: expected one of {METHODS}, got {self.method!r}")
        if self.method in ("awq",) and self.bits not in (2, 3, 4, 8):
            raise ValueError(f"bits: expected 2, 3, 4 or 8, got {self.bits}")


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


def _awq_fold(cm: CalibrationModel, i: int, stats: dict[str, InputStats], opts, info) -> None:
    """Search AWQ scales for each linear of layer i and fold them into the op before it."""
    layer = cm.layers[i]
    p = f"model.layers.{i}"
    attn, mlp = layer.self_attn, layer.mlp
    pairs = [("self_attn.qkv_proj", attn.qkv_proj, ("norm", layer.input_layernorm)),
             ("mlp.gate_up_proj", mlp.gate_up_proj, ("norm", layer.post_attention_layernorm)),
             ("mlp.down_proj", mlp.down_proj, ("rows", mlp.gate_up_proj, 1))]
    if attn.num_heads == attn.num_kv_heads:
        pairs.append(("self_attn.o_proj", attn.o_proj, ("rows", attn.qkv_proj, 2)))
    for name, module, prev in pairs:
        st = stats[f"{p}.{name}"]
        group = layer_group_cols(module.input_size, opts.group_size)
        res = awq.search_scales(module.weight.data, st.sample, opts.bits, group, opts.sym,
                                opts.awq_grid, st.abs_mean)
        info.setdefault("awq_alpha", {})[f"{p}.{name}"] = res.alpha
        s = res.scales
        if prev[0] == "norm":
            smoothquant.fold_into_norm(prev[1].weight.data, [module.weight.data], s)
        else:   # divide the producing shard's rows (up of gate_up, v of qkv)
            prod, shard = prev[1], prev[2]
            off = sum(prod.output_sizes[:shard])
            rows = prod.weight.data[off:off + prod.output_sizes[shard]]
            bias = None if prod.bias is None else prod.bias.data[off:off + rows.shape[0]]
            smoothquant.fold_into_rows(rows, bias, module.weight.data, s)


def _smooth(cm: CalibrationModel, i: int, stats: dict[str, InputStats], alpha: float) -> None:
    layer = cm.layers[i]
    p = f"model.layers.{i}"
    for name, module, norm in (("self_attn.qkv_proj", layer.self_attn.qkv_proj,
                                layer.input_layernorm),
                               ("mlp.gate_up_proj", layer.mlp.gate_up_proj,
                                layer.post_attention_layernorm)):
        s = smoothquant.smooth_scales(stats[f"{p}.{name}"].abs_max, [module.weight.data], alpha)
        smoothquant.fold_into_norm(norm.weight.data, [module.weight.data], s)


def quantize_layers(cm: CalibrationModel, windows: list[list[int]], opts: QuantizeOptions,
                    bits_plan: dict[str, int] | None = None, progress=None) -> QuantizeReport:
    """Quantize every decoder layer of `cm.model` in place; returns the per-layer plan."""
    report = QuantizeReport()
    needs_data = opts.method != "rtn"
    states = cm.embed(windows) if needs_data else None
    for i in range(len(cm.layers)):
        linears = cm.linear_layers(i)
        stats = None
        if needs_data:
            hessian = opts.method in ("gptq", "mixed")
            stats = {n: InputStats(m.input_size, hessian=hessian) for n, m in linears.items()}
            cm.run_layer(i, states, stats)
        if opts.method == "awq":
            _awq_fold(cm, i, stats, opts, report.info)
        if opts.method == "smoothquant":
            _smooth(cm, i, stats, opts.alpha)
        for name, module in linears.items():
            w = module.weight.data.float()
            if opts.method == "smoothquant":
                report.layers[name] = _install_w8a8(module)
                continue
            bits = bits_plan[name] if bits_plan else opts.bits
            group = layer_group_cols(module.input_size, opts.group_size)
            if opts.method in ("gptq", "mixed"):
                qt, perm = gptq_quantize(w, stats[name].hessian, bits, group, opts.sym,
                                         opts.block_size, opts.damp, opts.act_order)
            else:   # rtn, awq (AWQ's scales are already folded into w)
                qt, perm = rtn_quantize(w, bits, group, opts.sym), None
            report.layers[name] = _install_int(module, qt, perm, bits, opts.group_size, opts.sym)
        if needs_data and i + 1 < len(cm.layers):
            states = cm.run_layer(i, states)
        if progress is not None:
            progress(i)
    return report


def quantize_model(files, opts: QuantizeOptions, calib_text: str, device="cpu",
                   progress=None) -> tuple[CalibrationModel, QuantizeReport]:
    """Load `files` dense, quantize it by `opts`; returns the model and its plan."""
    cm = CalibrationModel(files, device)
    windows = token_windows(files.tokenizer(), calib_text, opts.seq_len, opts.num_windows)
    bits_plan = None
    info = {"calibration_windows": len(windows),
            "calibration_tokens": sum(len(w) for w in windows)}
    if opts.method == "mixed":
        from slipstream.quant.mixed_precision import plan_bits
        bits_plan, alloc = plan_bits(cm, windows, opts)
        info["allocation"] = alloc
    report = quantize_layers(cm, windows, opts, bits_plan, progress)
    report.info.update(info)
    return cm, report

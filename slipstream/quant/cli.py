"""`slipstream quantize MODEL -o OUT --method rtn|gptq|awq|smoothquant|mixed`."""
from __future__ import annotations

import argparse
import json
import sys
import time

from slipstream.commands.options import number


# GPTQ / AWQ settings whose defaults are QuantizeOptions' (chosen on held-out calibration
# windows, benchmarks/quant/README.md); None: that default.
TUNED = ("static_groups", "damp", "asym_calib", "clip_separate", "awq_duo", "awq_all_rows")
# quantizer.METHODS, spelled here so that option errors answer without importing torch
METHODS = ("rtn", "gptq", "awq", "smoothquant", "mixed")


def _group_size(text: str) -> int:
    # Checkpoints run through the block kernels (groups of 32 and multiples); other
    # widths would decode through a per-call dequantization, ~1000x slower.
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0 or value % 32:
        raise argparse.ArgumentTypeError(f"expected 0 (per channel) or a multiple of 32, got {text}")
    return value


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "quantize", help="quantize a model to a safetensors checkpoint slipstream loads back",
        description="Quantize a float (or GGUF, dequantized) model layer by layer and save it "
                    "as safetensors plus a quantization_config in config.json. Load the result "
                    "with `slipstream generate --model OUT` or LLM(OUT).")
    p.add_argument("model", nargs="?", default=None,
                   help="a Hugging Face folder or a .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument("-o", "--output", required=True, help="output folder")
    p.add_argument("--method", default="gptq", choices=METHODS, metavar="METHOD",
                   help="rtn, gptq, awq (weight-only int), smoothquant (W8A8 int8), mixed "
                        "(per-layer bits by sensitivity, GPTQ) (default: gptq)")
    p.add_argument("--bits", type=int, default=4, choices=(2, 3, 4, 8), metavar="BITS",
                   help="2, 3, 4 or 8 (default 4)")
    p.add_argument("--group-size", type=_group_size, default=128,
                   help="input columns per scale, a multiple of 32; 0 = one per output channel "
                        "(default 128)")
    p.add_argument("--sym", action="store_true", help="symmetric codes (default: asymmetric)")
    p.add_argument("--no-act-order", dest="act_order", action="store_false",
                   help="GPTQ: quantize columns in their stored order (default: by decreasing "
                        "Hessian diagonal)")
    p.add_argument("--no-true-sequential", dest="true_sequential", action="store_false",
                   help="GPTQ: quantize all of a decoder layer from its unquantized inputs "
                        "(default: qkv, o, gate_up, down in turn, each from quantized inputs)")
    p.add_argument("--static-groups", action=argparse.BooleanOptionalAction, default=None,
                   help="GPTQ act-order: fix every group's range up front so the codes stay in "
                        "input order (no gather of the layer's input at run time)")
    p.add_argument("--damp", type=number(float, 0.0, 1.0, low_open=True), default=None,
                   help="GPTQ: Hessian damping, a fraction in (0, 1] of its mean diagonal")
    p.add_argument("--asym-calib", type=number(float, 0.0, 1.0), default=None,
                   help="GPTQ: weight in [0, 1] of the asymmetric-calibration target (the "
                        "unquantized model's outputs from the quantized model's inputs, "
                        "GPTAQ); 0: plain GPTQ")
    p.add_argument("--clip-grid", type=number(int, 0), default=20,
                   help="GPTQ/AWQ: steps of the group-range clipping search; 0: none (default 20)")
    p.add_argument("--clip-separate", action=argparse.BooleanOptionalAction, default=None,
                   help="GPTQ: search the low and high ends of each group's range apart")
    p.add_argument("--awq-duo", action=argparse.BooleanOptionalAction, default=None,
                   help="AWQ: also try duo scaling mean|x|^a / mean|w|^(1-a)")
    p.add_argument("--awq-all-rows", action=argparse.BooleanOptionalAction, default=None,
                   help="AWQ: search scales and clipping on every calibration row (Gram "
                        "matrix) instead of a 2,048-row sample")
    p.epilog = ("Unset GPTQ/AWQ settings take QuantizeOptions' defaults "
                "(slipstream.quant.quantizer).")
    p.add_argument("--calib", default=None, help="calibration text file (default: a text "
                   "shipped with slipstream)")
    p.add_argument("--seq-len", type=number(int, 2), default=512,
                   help="tokens per calibration window")
    p.add_argument("--num-windows", type=number(int, 1), default=16,
                   help="calibration windows at most")
    p.add_argument("--alpha", type=number(float, 0.0, 1.0), default=None,
                   help="SmoothQuant migration strength in [0, 1] for every layer (default: "
                        "searched per layer on the calibration data)")
    p.add_argument("--avg-bits", type=number(float, 0.0, 8.0, low_open=True), default=3.5,
                   help="mixed: average bits budget, at least the smallest of --mixed-bits")
    p.add_argument("--mixed-bits", default=(3, 4, 8), type=_bit_list,
                   help="mixed: the bit widths a layer may get (default 3,4,8)")
    p.add_argument("--device", default="cpu", help="where to run calibration (cpu, cuda)")
    p.set_defaults(func=run)


def _bit_list(text: str) -> tuple[int, ...]:
    try:
        bits = tuple(sorted({int(b) for b in text.split(",")}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not bits or any(b not in (2, 3, 4, 8) for b in bits):
        raise argparse.ArgumentTypeError(f"each width must be 2, 3, 4 or 8, got {text!r}")
    return bits


def run(args) -> int:
    if args.method == "mixed" and args.avg_bits < min(args.mixed_bits):
        raise ValueError(f"--avg-bits {args.avg_bits} is below the smallest of --mixed-bits "
                         f"({min(args.mixed_bits)}): no allocation fits the budget")
    from tqdm import tqdm

    from slipstream.loader import open_model
    from slipstream.quant.calibration import read_calibration_text
    from slipstream.quant.checkpoint import save_quantized
    from slipstream.quant.quantizer import QuantizeOptions, quantize_model
    opts = QuantizeOptions(method=args.method, bits=args.bits,
                           group_size=args.group_size or None, sym=args.sym,
                           act_order=args.act_order, true_sequential=args.true_sequential,
                           clip_grid=args.clip_grid,
                           **{k: getattr(args, k) for k in TUNED if getattr(args, k) is not None},
                           alpha=args.alpha, seq_len=args.seq_len,
                           num_windows=args.num_windows, avg_bits=args.avg_bits,
                           mixed_bits=args.mixed_bits)
    text = read_calibration_text(args.calib)
    files = open_model(args.model)
    t0 = time.perf_counter()
    print(f"loading {files.path} (dense, for calibration"
          + ("; then each layer's sensitivity per bit width" if args.method == "mixed" else "")
          + ") ...", file=sys.stderr, flush=True)
    bars = []       # the layer bar starts with the first layer, not during the load

    def start(num_layers: int) -> None:
        bars.append(tqdm(total=num_layers, desc=f"{args.method} layers", unit="layer",
                         file=sys.stderr, mininterval=0))
    try:
        cm, report = quantize_model(files, opts, text, args.device, start=start,
                                    progress=lambda i: bars[0].update(1))
    finally:
        for bar in bars:
            bar.close()
    extra = {"options": dict(vars(opts)),
             "info": {k: v for k, v in report.info.items()
                      if k not in ("awq_alpha", "smoothquant_alpha")}}
    out = save_quantized(cm.model, files, args.output, report.layers, args.method, extra)
    print(f"quantized {files.path} with {args.method} in {time.perf_counter() - t0:.1f} s "
          f"-> {out}", file=sys.stderr)
    if "allocation" in report.info:
        a = report.info["allocation"]
        print(json.dumps({k: v for k, v in a.items() if k != "bits"}, indent=1), file=sys.stderr)
    return 0

"""`slipstream analyze`: the analysis layer from the command line.

Forms: `analyze MODEL [...]`, `analyze specdec [...]`, `analyze measure [...]`,
`analyze gpus`, `analyze models`. MODEL is a preset name, a config.json or a
model folder. The main CLI mounts this with `add_parser(subparsers)`;
`python -m slipstream.analysis ...` runs it alone.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Callable

from slipstream.analysis import tables
from slipstream.analysis.flops import Precisions, Workload
from slipstream.analysis.hardware import get_hardware, measure_profile, save_profile
from slipstream.analysis.presets import resolve_model
from slipstream.analysis.report import Scenario, analyze, render_text
from slipstream.analysis.roofline import decode_bound, step_bound
from slipstream.cli import Parser

_DESCRIPTION = """FLOPs, bytes moved and roofline bounds of a model on a GPU (reference chapter 1),
and the theory of speculative decoding (chapter 3.3-3.4).

  analyze MODEL [--gpu H100] [--batch B] [--context L] [--weight-dtype D] [--kv-dtype D]
                [--json] [--plot out.png]   MODEL: preset, config.json or model folder
  analyze specdec --alpha A --gamma G --c C [--gpu H100] [--json]
  analyze measure [--device cuda] [--out profile.json]
  analyze tp MODEL [--gpu H200] [--tp 1 2 4 8] [--link L | --link-bandwidth GB/s --link-latency us]
  analyze kv-transfer MODEL [--prompt 4096 ...] [--tp N] [--link L | --link-bandwidth GB/s --link-latency us]
  analyze gpus | analyze models

Each form takes --help."""


def _model_parser() -> argparse.ArgumentParser:
    p = Parser(prog="slipstream analyze", description="FLOPs, bytes and "
               "roofline bounds of a model on a GPU")
    p.add_argument("model", help="preset (see `analyze models`), config.json, or model folder")
    p.add_argument("--gpu", default="H100", help="A100, H100, H200, B200, or a measured profile")
    p.add_argument("--num-gpus", type=int, default=1,
                   help="GPUs sharing the model (tensor parallel; communication ignored)")
    p.add_argument("--batch", type=int, default=1, help="decode batch size")
    p.add_argument("--context", type=int, default=4096, help="keys each decoded token attends to")
    p.add_argument("--prompt", type=int, default=4096, help="prefill length")
    p.add_argument("--weight-dtype", default=None,
                   help="bf16, fp8, int8, int4, int4-g64, ... (default: what a model file stores, "
                        "read off its tensors; bf16 for presets and config.json)")
    p.add_argument("--kv-dtype", default="bf16", help="KV cache precision")
    p.add_argument("--compute-dtype", default="bf16", help="matmul precision for the peak rate")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", metavar="OUT", help="write a roofline chart (.png or .svg)")
    return p


def run_model(argv: list[str]) -> int:
    args = _model_parser().parse_args(argv)
    spec, hw = resolve_model(args.model), get_hardware(args.gpu).times(args.num_gpus)
    precisions, stored = _precisions(args, spec)
    sc = Scenario(args.batch, args.context, args.prompt, precisions, args.compute_dtype)
    data = analyze(spec, hw, sc)
    if stored is not None:
        data["stored_weights"] = {"source": stored.source, "bits": stored.weight.bits,
                                  "head_bits": stored.head.bits if stored.head else None}
    plot_error = None
    if args.plot:
        from slipstream.analysis.plots import plot_roofline
        phases = {"prefill": step_bound(spec, hw, Workload.prefill(sc.prompt), sc.precisions,
                                        sc.compute_dtype).ops(),
                  "decode": decode_bound(spec, hw, sc.batch, sc.context, sc.precisions,
                                         sc.compute_dtype).ops()}
        try:
            data["plot"] = str(plot_roofline(
                hw, phases, args.plot, compute_dtype=sc.compute_dtype,
                title=f"{spec.name} on {hw.name}: prefill N={sc.prompt}, "
                      f"decode B={sc.batch} L={sc.context}"))
        except ValueError as e:   # e.g. no matplotlib: the analysis itself still stands
            plot_error = e
    print(json.dumps(data, indent=2) if args.json else render_text(spec, hw, sc, data))
    if stored is not None and not args.json:
        head = f", LM head {stored.head.bits:.2f}" if stored.head else ""
        print(f"\nweights as the file stores them ({stored.source}): {stored.weight.bits:.2f} bits "
              f"a weight in the layers{head} (--weight-dtype overrides)")
    if plot_error is not None:
        print(f"error: no chart written: {plot_error}", file=sys.stderr)
        return 2
    if args.plot and not args.json:
        print(f"\nroofline chart written to {data['plot']}")
    return 0


def _precisions(args, spec):
    """--weight-dtype, or the precision the model file stores (None for presets)."""
    if args.weight_dtype is not None:
        return Precisions.parse(args.weight_dtype, args.kv_dtype), None
    from slipstream.analysis.flops import model_cost
    from slipstream.analysis.stored_precision import stored_precision
    cost = model_cost(spec, Workload(batch=1, new_tokens=1, past_tokens=0))
    linear = sum(op.params for layer in cost.layers for op in layer if op.matmul)
    stored = stored_precision(args.model, linear, spec.vocab_size * spec.hidden_size)
    base = Precisions.parse("bf16", args.kv_dtype)
    if stored is None:
        return base, None
    return Precisions(stored.weight, base.kv, base.act, stored.head,
                      head_when_tied=stored.head_tied and stored.head is not None), stored


def _tp_parser() -> argparse.ArgumentParser:
    p = Parser(prog="slipstream analyze tp",
               description="Tensor parallelism: all-reduce bytes per layer per "
               "token, communication time per step, and when TP pays")
    p.add_argument("model", help="preset, config.json, or model folder")
    p.add_argument("--gpu", default="H200", help="one device: A100, H100, H200, B200, or a profile")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8], help="sizes to compare")
    p.add_argument("--link", default="h200-nvlink-graph",
                   help="h200-nvlink (eager NCCL) or h200-nvlink-graph (inside a CUDA graph)")
    p.add_argument("--link-bandwidth", type=float, help="custom link: all-reduce bus GB/s")
    p.add_argument("--link-latency", type=float, help="custom link: us per small all-reduce")
    p.add_argument("--batch", type=int, default=1, help="decode batch size")
    p.add_argument("--context", type=int, default=4096, help="keys each decoded token attends to")
    p.add_argument("--prompt", type=int, default=4096, help="prefill length")
    p.add_argument("--weight-dtype", default="bf16")
    p.add_argument("--json", action="store_true")
    return p


def run_tp(argv: list[str]) -> int:
    from slipstream.analysis.tensor_parallel import get_link, render_tp, tp_rows
    args = _tp_parser().parse_args(argv)
    spec, hw = resolve_model(args.model), get_hardware(args.gpu)
    link = get_link(args.link, args.link_bandwidth and args.link_bandwidth * 1e9,
                    None if args.link_latency is None else args.link_latency * 1e-6)
    prec = Precisions.parse(args.weight_dtype)
    phases = {f"decode B={args.batch} L={args.context}": Workload.decode(args.batch, args.context),
              f"prefill N={args.prompt}": Workload.prefill(args.prompt)}
    data = {phase: tp_rows(spec, hw, link, args.tp, work, prec) for phase, work in phases.items()}
    if args.json:
        print(json.dumps({"model": spec.name, "gpu": hw.name, "link": link.name, **data}, indent=2))
    else:
        print("\n\n".join(render_tp(spec, hw, link, phase, rows) for phase, rows in data.items()))
    return 0


def _kv_transfer_parser() -> argparse.ArgumentParser:
    p = Parser(prog="slipstream analyze kv-transfer",
               description="Prefill/decode disaggregation: time to move a "
               "prompt's KV cache between instances (KV bytes per token x "
               "tokens / link bandwidth), against the prompt's prefill time")
    p.add_argument("model", help="preset, config.json, or model folder")
    p.add_argument("--prompt", type=int, nargs="+", default=[512, 1024, 4096, 16384],
                   help="prompt lengths (tokens)")
    p.add_argument("--block-size", type=int, default=16,
                   help="KV block size: the full blocks before the last token move")
    p.add_argument("--gpu", default="H200", help="device of the prefill roofline")
    p.add_argument("--link", default="h200-nvlink-p2p",
                   help="h200-nvlink-p2p (measured), pcie5-x16, ib-ndr-400, ethernet-100g")
    p.add_argument("--link-bandwidth", type=float, help="custom link: GB/s")
    p.add_argument("--link-latency", type=float, help="custom link: us per transfer")
    p.add_argument("--kv-dtype", default="bf16", help="KV cache precision")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel size of both instances: each rank pair moves its shard")
    p.add_argument("--json", action="store_true")
    return p


def run_kv_transfer(argv: list[str]) -> int:
    from dataclasses import asdict

    from slipstream.analysis.kv_transfer import (get_p2p_link, kv_transfer_cost, moved_tokens,
                                                 render_kv_transfer)
    args = _kv_transfer_parser().parse_args(argv)
    spec, hw = resolve_model(args.model), get_hardware(args.gpu)
    link = get_p2p_link(args.link, args.link_bandwidth and args.link_bandwidth * 1e9,
                        None if args.link_latency is None else args.link_latency * 1e-6)
    prec = Precisions.parse("bf16", args.kv_dtype)
    costs = [kv_transfer_cost(spec, hw, link, moved_tokens(n, args.block_size), prec, tp=args.tp)
             for n in args.prompt]
    if args.json:
        print(json.dumps({"model": spec.name, "gpu": hw.name, "link": link.name,
                          "rows": [dict(asdict(c), prompt_tokens=n, time_s=c.time)
                                   for n, c in zip(args.prompt, costs)]}, indent=2))
    else:
        print(render_kv_transfer(spec, hw, link, costs))
    return 0


def _specdec_parser() -> argparse.ArgumentParser:
    p = Parser(prog="slipstream analyze specdec",
               description="Speculative decoding: expected tokens per round, "
               "speedup, best draft length (chapter 3.3-3.4)")
    p.add_argument("--alpha", type=float, required=True, help="per-token acceptance rate")
    p.add_argument("--gamma", type=int, required=True, help="draft tokens per round")
    p.add_argument("--c", type=float, required=True, help="draft step time / target step time")
    p.add_argument("--gpu", help="also give the batch past which speculation stops paying")
    p.add_argument("--model", help="with --gpu: use this model's critical batch (KV included)")
    p.add_argument("--context", type=int, default=1, help="with --model: decode context")
    p.add_argument("--weight-dtype", default="bf16")
    p.add_argument("--json", action="store_true")
    return p


def run_specdec(argv: list[str]) -> int:
    args = _specdec_parser().parse_args(argv)
    data = tables.specdec_summary(args.alpha, args.gamma, args.c, args.gpu, args.model,
                                  args.context, args.weight_dtype)
    print(json.dumps(data, indent=2) if args.json else tables.render_specdec(data))
    return 0


def _measure_parser() -> argparse.ArgumentParser:
    p = Parser(prog="slipstream analyze measure",
               description="Measure copy bandwidth and bf16 matmul rate of this "
               "device and store the profile for benchmarks and --gpu")
    p.add_argument("--device", default="auto", help="cuda, cuda:1, cpu (auto: cuda if present)")
    p.add_argument("--out", help="profile path (default: ~/.cache/slipstream/hardware/<device>.json)")
    p.add_argument("--copy-mib", type=int, help="bytes copied per run, in MiB")
    p.add_argument("--matmul-n", type=int, help="square matmul size")
    p.add_argument("--json", action="store_true")
    return p


def run_measure(argv: list[str]) -> int:
    import torch
    args = _measure_parser().parse_args(argv)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    prof = measure_profile(device, args.copy_mib and args.copy_mib << 20, args.matmul_n)
    path = save_profile(prof, args.out)
    data = tables.measured_summary(prof, str(path))
    print(json.dumps(data, indent=2) if args.json else tables.render_measured(data))
    return 0


def _table_form(name: str, rows: Callable[[], list[dict]],
                render: Callable[[list[dict]], str]) -> Callable[[list[str]], int]:
    def run(argv: list[str]) -> int:
        p = Parser(prog=f"slipstream analyze {name}")
        p.add_argument("--json", action="store_true")
        table = rows()
        print(json.dumps(table, indent=2) if p.parse_args(argv).json else render(table))
        return 0
    return run


FORMS: dict[str, Callable[[list[str]], int]] = {
    "specdec": run_specdec, "measure": run_measure, "tp": run_tp,
    "kv-transfer": run_kv_transfer,
    "gpus": _table_form("gpus", tables.gpu_rows, tables.render_gpus),
    "models": _table_form("models", tables.model_rows, tables.render_models),
}


def main(argv: list[str] | None = None) -> int:
    """Dispatch on the first word: a form name, or else a model."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: slipstream analyze {{MODEL,{','.join(FORMS)}}} ...\n\n{_DESCRIPTION}",
              file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    try:
        return FORMS.get(argv[0], run_model)(argv[1:] if argv[0] in FORMS else argv)
    except ValueError as err:   # user errors: the message is the whole story
        print(f"error: {err}", file=sys.stderr)
        return 2


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Mount `analyze` on the main CLI; each form parses its own arguments."""
    # No option prefix of its own: every word, --help included, reaches main().
    p = subparsers.add_parser("analyze", help="FLOPs, bytes, roofline bounds; spec-decode theory",
                              add_help=False, prefix_chars="+")
    p.add_argument("argv", nargs=argparse.REMAINDER)
    p.set_defaults(func=lambda args: main(args.argv))
    return p

"""Perplexity of each quantization method on the default model (CPU, real weights).

The default model is SmolLM2-135M-Instruct from a Q4_1 GGUF file: its weights are
already 4-bit (Q4_1, block 32) on disk. Dequantized to fp32 they are this
benchmark's "unquantized" baseline; every method re-quantizes those fp32 weights.

Perplexity: the fixed text benchmarks/quant/eval_text.txt (a snapshot of the
project's README and design notes) is cut into non-overlapping windows of
--context tokens; every token of a window after its first is scored given the
tokens before it in the same window; ppl = exp(mean negative log-likelihood).
Scores come from the engine itself (`LLM.generate` with prompt_logprobs). W8A8 (int8,
fp8) runs its runtime path (per-token activation quantization, int32 or fp8 products);
weight-only methods are scored with their dequantized weights in dense layers, which
computes the same log-probs (see densify_weight_only) at a fraction of the CPU time.

Calibration (GPTQ, AWQ, SmoothQuant, mixed): the set that ships with slipstream
(slipstream/quant/data/, about 28,700 tokens), 16 windows of 512 tokens spread over it
(the default of QuantizeOptions and `slipstream quantize`); it shares no text
with the evaluation file (tests/quant/test_calibration_data.py). Per-token NLLs go to
OUT/nll/ (not committed); quality_report.py turns them into bootstrap intervals.

    PYTHONPATH=. python benchmarks/quant/quality.py [--out benchmarks/quant/results]
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import shutil
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from quality_report import bootstrap, markdown, save_nll  # noqa: E402

# name -> (load-time scheme, or `slipstream quantize` options), description
METHODS = {
    "baseline": ({"quantization": None}, "fp32 (the Q4_1 GGUF dequantized)"),
    "rtn-w4g128": ({"quantization": "rtn-int4"}, "RTN int4, asymmetric, group 128, at load"),
    "gptq-w4g128": ({"quantize": dict(method="gptq", bits=4)},
                    "GPTQ int4 g128: act-order, true-sequential, range search, damp 0.01, "
                    "asymmetric calibration 0.5 (GPTAQ)"),
    "awq-w4g128": ({"quantize": dict(method="awq", bits=4)},
                   "AWQ int4 g128: scales at 4 sites per layer + clipping search, "
                   "searches on all calibration rows"),
    "rtn-w3g128": ({"quantization": "rtn-int3"}, "RTN int3 g128, at load"),
    "gptq-w3g128": ({"quantize": dict(method="gptq", bits=3, asym_calib=0.0)},
                    "GPTQ int3 g128 (as gptq-w4g128-sym-calib)"),
    "int8-w8a16": ({"quantization": "int8"}, "int8 weights per channel, at load"),
    "w8a8-int8": ({"quantization": "w8a8"}, "int8 W8A8 without smoothing, at load"),
    "smoothquant-w8a8": ({"quantize": dict(method="smoothquant")},
                         "SmoothQuant int8 W8A8, 4 sites per layer, alpha searched per site"),
    "fp8-w8a8": ({"quantization": "fp8"}, "fp8 e4m3 W8A8, at load"),
    "mixed-3.5bit": ({"quantize": dict(method="mixed", avg_bits=3.5, asym_calib=0.0)},
                     "per-layer bits in {3,4,8} at 3.5 average, GPTQ (as gptq-w4g128-sym-calib)"),
    "kv-int8": ({"kv": "int8"}, "fp32 weights, KV cache int8 per token and head (simulated)"),
    "kv-fp8": ({"kv": "fp8"}, "fp32 weights, KV cache fp8 e4m3 per token and head (simulated)"),
}
# Rows outside the default list: ablations, earlier experiments (kept by --merge).
OPTIONAL = {
    "gptq-w4g128-sym-calib": ({"quantize": dict(method="gptq", bits=4, asym_calib=0.0)},
                              "GPTQ int4 g128 as gptq-w4g128 without asymmetric calibration "
                              "(the earlier default)"),
    "gptq-w3g128-asym": ({"quantize": dict(method="gptq", bits=3)},
                         "GPTQ int3 g128 as gptq-w4g128 (asymmetric calibration 0.5)"),
    "awq-w4g128-sample": ({"quantize": dict(method="awq", bits=4, awq_all_rows=False)},
                          "AWQ int4 g128 as awq-w4g128, searches on a 2,048-row sample "
                          "(the earlier default)"),
    "gptq-w4g128-plain": ({"quantize": dict(method="gptq", bits=4, act_order=False,
                                            true_sequential=False, clip_grid=0)},
                          "GPTQ int4 g128 without act-order, true-sequential, range search"),
    "gptq-w4g128-static": ({"quantize": dict(method="gptq", bits=4, static_groups=True)},
                           "GPTQ int4 g128 as gptq-w4g128, static groups (codes in input order)"),
    "awq-w4g128-noclip": ({"quantize": dict(method="awq", bits=4, clip_grid=0,
                                            awq_all_rows=False)},
                          "AWQ int4 g128, scales only (no clipping search)"),
    "smoothquant-w8a8-a0.5": ({"quantize": dict(method="smoothquant", alpha=0.5)},
                              "SmoothQuant int8 W8A8, 4 sites per layer, alpha 0.5"),
    "gptq-w4g128-damp0.1": ({"quantize": dict(method="gptq", bits=4, damp=0.1, asym_calib=0.0)},
                            "GPTQ int4 g128 as gptq-w4g128-sym-calib, damping 0.1"),
    "gptq-w4g128-noclip": ({"quantize": dict(method="gptq", bits=4, clip_grid=0,
                                             asym_calib=0.0)},
                           "GPTQ int4 g128 as gptq-w4g128-sym-calib, no range search"),
    "mixed-3.5bit-with-2bit": ({"quantize": dict(method="mixed", avg_bits=3.5, asym_calib=0.0,
                                                 mixed_bits=(2, 3, 4, 8))},
                               "per-layer bits in {2,3,4,8} at 3.5 average, GPTQ"),
}


def simulate_kv_cache(llm, kv_dtype: str) -> None:
    """Every K/V entering the cache takes the values an int8/fp8 cache would hand back
    (quant/kv_quant.py's per-token-per-head formats): the attention kernels do not read
    quantized caches yet, so the cache's numerics are simulated exactly at the store."""
    from slipstream.quant.kv_quant import fake_quantize_kv
    for layer in llm.engine.runner.model.attention_layers():
        forward = layer.forward

        def quantized(q, k, v, batch, forward=forward):
            return forward(q, fake_quantize_kv(k, kv_dtype), fake_quantize_kv(v, kv_dtype), batch)
        layer.forward = quantized


def densify_weight_only(llm) -> int:
    """Swap every weight-only integer layer for a dense layer holding its dequantized weight.

    An evaluation shortcut, not an approximation: tests/quant/test_engine_schemes.py and
    test_quantize_checkpoint.py show the quantized layers compute what dense layers holding
    the dequantized weights compute (log-probs equal to 2e-4). Dequantizing once instead of
    at every forward makes the CPU evaluation affordable. Activation-quantized methods
    (W8A8 int8, fp8) keep their runtime path. Returns the number of layers swapped."""
    return densify_model(llm.engine.runner.model, llm.engine.config.dtype)


def densify_model(model, dtype=torch.float32) -> int:
    """densify_weight_only on a bare model (benchmarks/quant/heldout.py)."""
    from torch import nn

    from slipstream.layers.linear import UnquantizedLinearMethod
    from slipstream.quant.int_weight import IntWeightMethod
    from slipstream.quant.primitives import dequantize_codes, unpack_codes
    swapped = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if not isinstance(method, IntWeightMethod):
            continue
        codes = unpack_codes(module.qweight, method.bits)
        zero = module.qzeros.float() if not method.sym else \
            torch.full_like(module.scales, 2.0 ** (method.bits - 1))
        w = dequantize_codes(codes, module.scales, zero, module.group_cols)
        perm = getattr(module, "perm", None)
        if perm is not None:
            full = torch.empty_like(w)
            full[:, perm.long()] = w
            w = full
        for name in ("qweight", "scales", "qzeros", "perm"):
            if hasattr(module, name):
                delattr(module, name)
        module.weight = nn.Parameter(w.to(dtype), requires_grad=False)
        module.quant_method = UnquantizedLinearMethod()
        swapped += 1
    return swapped


def perplexity(llm, windows: list[list[int]]) -> tuple[float, list[float]]:
    from quality_report import nll_of, ppl_of
    from slipstream import SamplingParams
    sp = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
    nll = nll_of(llm.generate([{"prompt_token_ids": w} for w in windows], sp, use_tqdm=False))
    return ppl_of(nll), nll


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--methods", default=",".join(METHODS),
                    help=f"comma-separated; also: {', '.join(OPTIONAL)}")
    ap.add_argument("--calib", default=None,
                    help="calibration text file (default: the one shipped with slipstream)")
    ap.add_argument("--merge", action="store_true",
                    help="keep the other methods' rows of an existing quality.json")
    ap.add_argument("--collect", default=None,
                    help="comma-separated result folders of earlier runs (e.g. run in parallel "
                         "with --methods subsets): their rows and NLLs join this run's table")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (1: on a shared 2-core machine, more threads only "
                         "wait for each other)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from slipstream import LLM
    from slipstream.loader import default_model_path, open_model
    from slipstream.quant.calibration import default_calibration_text
    from slipstream.quant.checkpoint import save_quantized
    from slipstream.quant.quantizer import QuantizeOptions, quantize_model
    torch.manual_seed(0)
    calib_text = (Path(args.calib).read_text(encoding="utf-8") if args.calib
                  else default_calibration_text())
    model = str(default_model_path())
    files = open_model(model)
    tok = files.tokenizer()
    ids = tok.encode((HERE / "eval_text.txt").read_text(encoding="utf-8"))
    windows = [ids[i:i + args.context] for i in range(0, len(ids), args.context)]
    windows = [w for w in windows if len(w) > 1]
    opts = dict(dtype="float32", device="cpu", max_model_len=args.context + 8,
                enable_prefix_caching=False)
    rows = []
    tmp = Path(tempfile.mkdtemp())
    for name in [m for m in args.methods.split(",") if m]:
        spec, desc = {**METHODS, **OPTIONAL}[name]
        t0 = time.perf_counter()
        info = {}
        if "quantize" in spec:
            q = QuantizeOptions(**spec["quantize"])
            cm, report = quantize_model(files, q, calib_text)
            path = save_quantized(cm.model, files, tmp / name, report.layers, q.method)
            info = {k: v for k, v in report.info.items()
                    if k not in ("awq_alpha", "smoothquant_alpha")}
            for key in ("awq_alpha", "smoothquant_alpha"):
                if key in report.info:   # how often each alpha was chosen
                    vals = list(report.info[key].values())
                    info[key + "_histogram"] = {str(a): vals.count(a)
                                                for a in sorted(set(vals), key=str)}
            if "allocation" in info:
                info["allocation"] = {k: v for k, v in info["allocation"].items() if k != "bits"}
                bits = list(report.info["allocation"]["bits"].values())
                info["bits_histogram"] = {b: bits.count(b) for b in sorted(set(bits))}
            del cm
            llm = LLM(str(path), **opts)
        elif "kv" in spec:
            llm = LLM(model, **opts, quantization=None)   # dense fp32, not the GGUF blocks
            simulate_kv_cache(llm, spec["kv"])
        else:
            llm = LLM(model, **opts, **spec)
        swapped = densify_weight_only(llm)
        if swapped:
            info["weight_only_layers_scored_dense_dequantized"] = swapped
        prep = time.perf_counter() - t0
        ppl, nll = perplexity(llm, windows)
        n = len(nll)
        save_nll(Path(args.out), name, nll)
        del llm
        rows.append({"method": name, "description": desc, "ppl": ppl, "tokens": n,
                     "prepare_s": round(prep, 1), **({"info": info} if info else {})})
        print(f"{name:24s} ppl {ppl:8.4f}  ({n} tokens, prepared in {prep:.0f} s)", flush=True)
        # The rows so far, in case the run is stopped (--collect reads them too).
        (Path(args.out) / "quality.partial.json").write_text(json.dumps({"results": rows}))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for d in (args.collect.split(",") if args.collect else []):
        d = Path(d)
        f = d / "quality.json" if (d / "quality.json").is_file() else d / "quality.partial.json"
        got = {r["method"]: r for r in json.loads(f.read_text())["results"]}
        rows = [r for r in rows if r["method"] not in got] + list(got.values())
        for name in got:
            if (d / "nll" / f"{name}.txt").is_file():
                (out / "nll").mkdir(parents=True, exist_ok=True)
                shutil.copy(d / "nll" / f"{name}.txt", out / "nll" / f"{name}.txt")
    if args.merge and (out / "quality.json").is_file():
        new = {r["method"]: r for r in rows}
        old = json.loads((out / "quality.json").read_text())["results"]
        rows = [new.pop(r["method"], r) for r in old] + list(new.values())
    order = [o for m in METHODS for o in [m] + [k for k in OPTIONAL if k.startswith(m + "-")]]
    order += [k for k in OPTIONAL if k not in order]
    rows.sort(key=lambda r: order.index(r["method"]) if r["method"] in order else len(order))
    meta = {"model": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to fp32 = baseline)",
            "text": "benchmarks/quant/eval_text.txt", "context": args.context,
            "scoring": "non-overlapping windows, first token of each window unscored",
            "calibration": (args.calib or "the default set shipped with slipstream "
                            "(slipstream/quant/data/)") + ": 16 windows of 512 tokens spread over "
                           "it (8,192 tokens, QuantizeOptions' default)",
            "machine": platform.processor() or platform.machine(), "torch": torch.__version__}
    noise = bootstrap(out, rows)
    for r in rows:
        if r["method"] in noise:
            r["noise"] = noise[r["method"]]
    (out / "quality.json").write_text(json.dumps({"meta": meta, "results": rows}, indent=1))
    (out / "quality.md").write_text(markdown(meta, rows, noise))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Perplexity on held-out calibration windows: how quantization settings are chosen
without looking at the evaluation text (benchmarks/quant/eval_text.txt).

The shipped calibration set (slipstream/quant/data/) is cut into windows of 512 tokens
(56 of them). Eight windows, 1, 8, 15, ..., 50 (one in seven, the first of the hand-written
prose and seven of the model-sampled text), are held out: none of them is among the 16
windows the default calibration takes (0, 3, 7, ..., 52) and, with --pool, none is used
for calibration at all. A setting is scored by the perplexity of the model quantized with
it on those eight windows (4,088 scored tokens; the first token of each window unscored),
computed by the calibration model itself on dequantized weights.

    PYTHONPATH=. python benchmarks/quant/heldout.py --method gptq --set damp=0.05 \
        [--windows 16] [--pool] [--log heldout.jsonl]

--windows N: calibration windows; by default the same windows as `slipstream quantize`
(N spread over all 56); with --pool, N spread over the 48 windows that are not held out
(needed for N > 16, where the spread would reach held-out windows).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

HELD_OUT = tuple(range(1, 56, 7))   # 1, 8, 15, 22, 29, 36, 43, 50


def parse_value(v: str):
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    if v in ("True", "False", "None"):
        return {"True": True, "False": False, "None": None}[v]
    if "," in v:
        return tuple(parse_value(x) for x in v.split(","))
    return v


def densify(model) -> int:
    """Every weight-only integer layer of `model` -> a dense layer with its dequantized weight."""
    sys.path.insert(0, str(Path(__file__).parent))
    from quality import densify_model
    return densify_model(model)


@torch.no_grad()
def heldout_nll(cm, windows: list[list[int]]) -> list[float]:
    states = cm.embed(windows)
    for i in range(len(cm.layers)):
        states = cm.run_layer(i, states)
    nll = []
    for logits, w in zip(cm.logits(states), windows):
        lp = torch.log_softmax(logits.float(), -1)[:-1]
        nll += (-lp.gather(1, torch.tensor(w[1:])[:, None])[:, 0]).tolist()
    return nll


def split_windows(tokenizer, text: str, seq_len: int = 512):
    ids = tokenizer.encode(text)
    return [ids[i:i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--method", default="gptq", help="baseline, rtn or a quantize method")
    ap.add_argument("--set", nargs="*", default=[], help="QuantizeOptions fields, key=value")
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--pool", action="store_true",
                    help="calibration windows from the 48 not held out (else as quantize)")
    ap.add_argument("--log", default=None, help="append one JSON line per run")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    from slipstream.loader import default_model_path, open_model
    from slipstream.quant.calibration import CalibrationModel, default_calibration_text
    from slipstream.quant.quantizer import QuantizeOptions, quantize_layers
    files = open_model(str(default_model_path()))
    allw = split_windows(files.tokenizer(), default_calibration_text())
    held = [allw[i] for i in HELD_OUT]
    overrides = dict(kv.split("=", 1) for kv in args.set)
    overrides = {k: parse_value(v) for k, v in overrides.items()}
    t0 = time.perf_counter()
    cm = CalibrationModel(files)
    if args.method != "baseline":
        method = "rtn" if args.method == "rtn" else args.method
        opts = QuantizeOptions(method=method, num_windows=args.windows, **overrides)
        if args.pool:
            pool = [w for i, w in enumerate(allw) if i not in HELD_OUT]
        else:
            pool = allw
        step = len(pool) / args.windows
        calib = [pool[int(i * step)] for i in range(args.windows)]
        if not args.pool and set(int(i * step) for i in range(args.windows)) & set(HELD_OUT):
            raise SystemExit("these calibration windows include held-out ones: use --pool")
        quantize_layers(cm, calib, opts)
        densify(cm.model)
    prep = time.perf_counter() - t0
    nll = heldout_nll(cm, held)
    ppl = math.exp(sum(nll) / len(nll))
    row = {"method": args.method, "set": overrides, "windows": args.windows, "pool": args.pool,
           "heldout_ppl": round(ppl, 4), "tokens": len(nll), "prepare_s": round(prep, 1)}
    print(json.dumps(row), flush=True)
    if args.log:
        with open(args.log, "a") as f:
            f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

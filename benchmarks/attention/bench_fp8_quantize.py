"""The FP8 Gluon prefill's input quantiser (kernels/fp8_quantize.py) with V^T's tokens in
the keys' order and in the P operand's order (key_perm, the default), against the PyTorch
version, on the attention benchmark's token count (16 heads, hdim 128, 16k tokens).

    python benchmarks/attention/bench_fp8_quantize.py --out DIR     # H200, ~30 s
    python benchmarks/attention/bench_fp8_quantize.py --smoke       # CPU interpreter, plumbing

Each fused variant is first checked against the PyTorch one (same columns, scales, codes),
then all are timed interleaved (do_bench medians, L2 flushed). Writes fp8_quantize.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE)]

SHAPES = [("4 x 4k", [4096] * 4, 16), ("1 x 16k", [16384], 16), ("GQA 16/4, 4 x 4k", [4096] * 4, 4),
          ("12 ragged", [245, 3091, 1024, 800, 2048, 512, 1500, 3000, 700, 1200, 1000, 1264], 16)]
SMOKE_SHAPES = [("2 x 100", [100, 100], 4)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=HERE / "results" / "fp8_quantize")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    import triton
    from timing import interleaved
    from slipstream.kernels.fp8_quantize import quantize_fp8_inputs_fused
    from slipstream.kernels.gluon_fp8_inputs import dequantize_fp8_inputs, quantize_fp8_inputs
    dev = "cpu" if args.smoke else "cuda"
    heads, d = (4, 64) if args.smoke else (16, 128)

    def ms(fn):
        if dev == "cpu":
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")

    res = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu (smoke)",
           "torch": torch.__version__, "triton": triton.__version__, "shapes": []}
    for name, lengths, kv_heads in SMOKE_SHAPES if args.smoke else SHAPES:
        gen = torch.Generator(device=dev).manual_seed(0)
        dtype = torch.float32 if args.smoke else torch.bfloat16
        tokens = sum(lengths)
        q = torch.randn(tokens, heads, d, device=dev, dtype=dtype, generator=gen)
        k, v = (torch.randn(tokens, kv_heads, d, device=dev, dtype=dtype, generator=gen) for _ in range(2))
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=dev)
        n = max(lengths)
        row = {"shape": name, "tokens": tokens, "kv_heads": kv_heads, "checks": {}}
        calls = {"torch": lambda: quantize_fp8_inputs(q, k, v, cu)}
        for perm in (False, True):
            label = "fused_key_perm" if perm else "fused_keys_order"
            a = quantize_fp8_inputs_fused(q, k, v, cu, n, key_perm=perm)
            b = quantize_fp8_inputs(q, k, v, cu, key_perm=perm)
            same_v = (dequantize_fp8_inputs(a)[2] - dequantize_fp8_inputs(b)[2]).abs().max().item()
            row["checks"][label] = {"v_cols_equal": bool(torch.equal(a.v_cols, b.v_cols)),
                                    "v_scale_equal": bool(torch.allclose(a.v_scale, b.v_scale, rtol=1e-5)),
                                    "v_max_abs_diff": same_v}
            calls[label] = lambda perm=perm: quantize_fp8_inputs_fused(q, k, v, cu, n, key_perm=perm)
        t = interleaved({c: (lambda f=f: ms(f)) for c, f in calls.items()}, rounds=1 if args.smoke else 5)
        row["ms"] = {c: x["ms"] for c, x in t.items()}
        row["spread"] = {c: x["spread"] for c, x in t.items()}
        res["shapes"].append(row)
        print(name, {c: round(x, 3) for c, x in row["ms"].items()}, row["checks"], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fp8_quantize.json").write_text(json.dumps(res, indent=1))
    lines = [f"# FP8 input quantiser, ms\n\n{res['device']}, torch {res['torch']}, triton {res['triton']}\n",
             "| shape | torch | fused, keys' order | fused, P operand's order (key_perm) | key_perm / keys' order |",
             "|---|---:|---:|---:|---:|"]
    for r in res["shapes"]:
        m = r["ms"]
        lines.append(f"| {r['shape']} | {m['torch']:.3f} | {m['fused_keys_order']:.3f} | "
                     f"{m['fused_key_perm']:.3f} | {m['fused_key_perm'] / m['fused_keys_order']:.2f}x |")
    (args.out / "fp8_quantize.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

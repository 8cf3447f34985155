"""The weight-streaming GEMV (kernels/int_weight_gemv.py) over its launch parameters
at batch 1: rows per program and warps, the loop's pipeline stages (1: one tile in
flight, the launch before the loop was pipelined) or the manual prefetch, on
Llama-3-8B shapes, against bf16 F.linear in the same run. Each config's output is
checked against the plain-PyTorch twin first. Times are triton do_bench medians
(L2 cleared before each run, so the weights come from HBM).

    python benchmarks/quant/gemv_sweep.py [--out DIR] [--smoke] [--budget-s S]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.quant.bench_quant_gemm import make_weights  # noqa: E402
from slipstream.kernels import reference  # noqa: E402
from slipstream.kernels.int_weight_gemv import default_gemv_config, int_weight_gemv, pick_tile  # noqa: E402
from slipstream.kernels.quant_gemm import _launch_int_weight  # noqa: E402
from slipstream.kernels.quant_tuning import default_config  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}


def configs(n, k, tile, device):
    base = default_gemv_config(1, n, k, tile, device)
    out = []
    for block_n, warps in ((64, 4), (128, 4), (64, 2)):
        split = max(1, base["SPLIT_K"] * 64 // block_n)
        for stages, prefetch in ((1, False), (1, True), (3, False), (4, False), (6, False)):
            if split <= k // tile and (stages, prefetch, block_n, warps) != (1, False, 64, 2):
                out.append(dict(BLOCK_N=block_n, SPLIT_K=split, num_warps=warps,
                                num_stages=stages, PREFETCH=prefetch))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--budget-s", type=float, default=100)
    args = ap.parse_args()
    t0 = time.perf_counter()
    dev = "cpu" if args.smoke else "cuda"
    dtype = torch.float32 if args.smoke else torch.bfloat16
    shapes = {"qkv": (64, 256)} if args.smoke else SHAPES
    gen = torch.Generator().manual_seed(0)
    from triton.testing import do_bench
    rows = []
    for name, (n, k) in shapes.items():
        W = make_weights(n, k, dev, gen, dtype)
        x = (torch.randn(1, k, generator=gen) * 0.5).to(dev, dtype)
        w4t, s4t, z4t = W["w4t"]
        tile = pick_tile(k, 128, 4)
        qw, s, z = W["w4"]
        want = reference.int_weight_linear(x.float(), qw, s, z, 4, 128)
        bf16_us = None if args.smoke else do_bench(lambda: F.linear(x, W["bf16"]), rep=50) * 1e3
        for cfg in configs(n, k, tile, torch.device(dev)):
            if time.perf_counter() - t0 > args.budget_s:
                rows.append(dict(shape=name, **cfg, error="time budget"))
                continue
            call = lambda: int_weight_gemv(x, w4t, s4t, z4t, 4, 128, tile, config=cfg)  # noqa: E731
            try:
                err = (call().float() - want).abs().max().item() / want.abs().max().item()
                us = None if args.smoke else do_bench(call, rep=50) * 1e3
                rows.append(dict(shape=name, **cfg, rel_err=err, us=us, bf16_us=bf16_us,
                                 speedup=(bf16_us / us) if us else None))
            except Exception as e:   # a config that does not compile or run: reported
                rows.append(dict(shape=name, **cfg, error=repr(e)[:200]))
            r = rows[-1]
            print(name, {k_: v for k_, v in r.items() if k_ != "shape"}, flush=True)
        if name == "qkv":   # 4 rows (a batch of 4, a short draft): the GEMV against the tensor-core kernel
            x4 = (torch.randn(4, k, generator=gen) * 0.5).to(dev, dtype)
            want4 = reference.int_weight_linear(x4.float(), qw, s, z, 4, 128)
            bf16_4 = None if args.smoke else do_bench(lambda: F.linear(x4, W["bf16"]), rep=50) * 1e3
            tc = dict(default_config(16, tile), BLOCK_K=tile)
            calls = {"tensor-core " + str(tc): lambda: _launch_int_weight(x4, w4t, s4t, z4t, 4, 128, tc, tile)}
            for cfg in configs(n, k, tile, torch.device(dev))[:5]:
                calls["gemv " + str(cfg)] = (lambda c=cfg: int_weight_gemv(x4, w4t, s4t, z4t, 4, 128,
                                                                           tile, config=c))
            for label, call in calls.items():
                try:
                    err = (call().float() - want4).abs().max().item() / want4.abs().max().item()
                    us = None if args.smoke else do_bench(call, rep=50) * 1e3
                    rows.append(dict(shape="qkv-m4", kernel=label, rel_err=err, us=us,
                                     bf16_us=bf16_4, speedup=(bf16_4 / us) if us else None))
                except Exception as e:
                    rows.append(dict(shape="qkv-m4", kernel=label, error=repr(e)[:200]))
                print("qkv-m4", rows[-1], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gemv_sweep.json").write_text(json.dumps(dict(device=torch.cuda.get_device_name()
                                                         if dev == "cuda" else "cpu",
                                                         torch=torch.__version__, rows=rows),
                                                    indent=1))
    for name in shapes:
        ok = [r for r in rows if r["shape"] == name and r.get("us")]
        if ok:
            b = min(ok, key=lambda r: r["us"])
            print(f"best {name}: {b['us']:.1f} us, {b['speedup']:.2f}x bf16 ({b['bf16_us']:.1f} us): "
                  f"{ {k_: b[k_] for k_ in ('BLOCK_N', 'SPLIT_K', 'num_warps', 'num_stages', 'PREFETCH')} }")


if __name__ == "__main__":
    main()

"""Quick probe of the FP8 Gluon prefill kernel on an H200: errors against fp32
SDPA and against its PyTorch twin (emulate_fp8_prefill), then a rough timing
against the bf16 Gluon kernel. Each step in a try: a failure is printed, the
rest runs. python benchmarks/attention/probe_gluon_fp8.py --out DIR"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from gluon_checks import reference, rel_err  # noqa: E402
from slipstream.kernels.gluon_fp8_inputs import emulate_fp8_prefill, quantize_fp8_inputs  # noqa: E402
from slipstream.kernels.gluon_fp8_prefill import gluon_fp8_prefill  # noqa: E402
from slipstream.kernels.gluon_prefill import gluon_prefill  # noqa: E402
from slipstream.kernels.fp8_attention import fp8_prefill_attention  # noqa: E402

CASES = [([1, 63, 128, 129, 700, 1500], 16, 4, True, 128), ([256, 1000, 333], 8, 8, False, 128),
         ([100, 1000], 9, 3, True, 64), ([4096] * 4, 16, 16, True, 128)]
res = {}


def data(lengths, heads, kv_heads, dim):
    g = torch.Generator(device="cuda").manual_seed(0)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lengths), heads, dim, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(sum(lengths), kv_heads, dim, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(2))
    return q, k, v, cu


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "benchmarks/attention/results/probe_fp8"))
    out = Path(ap.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)
    threading.Timer(170, lambda: (print('WATCHDOG: hang after 170 s', flush=True), os._exit(3))).start()
    for cfg in ({"PERSISTENT": False}, {"PERSISTENT": True}):
        for lengths, heads, kvh, causal, dim in CASES:
            name = f"{cfg} {len(lengths)}seqs h{heads}/{kvh} d{dim} causal={causal}"
            try:
                q, k, v, cu = data(lengths, heads, kvh, dim)
                x = quantize_fp8_inputs(q, k, v, cu)
                o = gluon_fp8_prefill(x, cu, max(lengths), dim ** -0.5, causal=causal, config=cfg)
                torch.cuda.synchronize()
                ref = reference(q.float(), k.float(), v.float(), cu, causal, dim ** -0.5)
                em = emulate_fp8_prefill(x, cu, dim ** -0.5, causal=causal)
                old = fp8_prefill_attention(q, k, v, cu, max(lengths), dim ** -0.5, causal=causal)
                res[name] = {"err_vs_fp32": rel_err(o, ref), "err_vs_twin": rel_err(o, em),
                             "triton_fp8_err_vs_fp32": rel_err(old, ref),
                             "twin_vs_fp32": rel_err(em, ref),
                             "max_abs": (o.float() - ref).abs().max().item()}
            except Exception:
                res[name] = {"error": traceback.format_exc()[-1500:]}
            print(name, res[name], flush=True)
            (out / "probe_fp8.json").write_text(json.dumps(res, indent=1))
    for lengths in ([4096] * 4, [16384]):
        try:
            q, k, v, cu = data(lengths, 16, 16, 128)
            x = quantize_fp8_inputs(q, k, v, cu)
            flops = 4 * 16 * 128 * sum(n * n for n in lengths) / 2
            t = {"gluon_bf16": do_bench(lambda: gluon_prefill(q, k, v, cu, max(lengths), 128 ** -0.5)),
                 "gluon_fp8": do_bench(lambda: gluon_fp8_prefill(x, cu, max(lengths), 128 ** -0.5)),
                 "gluon_fp8_persistent": do_bench(lambda: gluon_fp8_prefill(
                     x, cu, max(lengths), 128 ** -0.5, config={"PERSISTENT": True})),
                 "triton_fp8_with_quant": do_bench(lambda: fp8_prefill_attention(
                     q, k, v, cu, max(lengths), 128 ** -0.5)),
                 "quantize": do_bench(lambda: quantize_fp8_inputs(q, k, v, cu))}
            res[f"time {lengths[0]}x{len(lengths)} causal"] = {
                kk: {"ms": ms, "tflops": flops / ms / 1e9} for kk, ms in t.items()}
        except Exception:
            res[f"time {lengths}"] = {"error": traceback.format_exc()[-1500:]}
        print(json.dumps(res.get(f"time {lengths[0]}x{len(lengths)} causal", res.get(f"time {lengths}"))), flush=True)
        (out / "probe_fp8.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
    os._exit(0)

"""The decode GEMV's cases for bench_decode_kernels.py: kernels/dense_gemv.py against
cuBLAS at batch 1 for the Llama-3-8B layer's weights, alone and after the kernel
that precedes each weight in a decode step."""
from __future__ import annotations

import math

HEADS, HEAD_DIM = 32, 128
# Batch-1 GEMV against cuBLAS at the layer's weight shapes (N, K), and its configs.
GEMV_SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096),
               "down": (4096, 14336)}
GEMV_CONFIGS = {"N32K256s4": (32, 256, 4, 4), "N32K512s3": (32, 512, 4, 3),
                "N64K256w8s4": (64, 256, 8, 4), "N16K512s4": (16, 512, 4, 4)}


def _gemv_cfg(name, prefetch=0):
    bn, bk, w, st = GEMV_CONFIGS[name]
    return {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w, "num_stages": st, "PREFETCH_K": prefetch}


def gemv(torch, device, dtype, smoke, timer, err, setup) -> dict:
    """Batch-1 GEMV (kernels/dense_gemv.py) against cuBLAS at the 8B layer's weights,
    alone, then after the kernel before it in a decode step (which lets it launch
    early: its L2 prefetch of the weight overlaps that kernel). timer(calls) -> ms per
    call; err(torch, got, want, tol) -> {max_abs_err, ok}; setup(context, copies) -> the
    batch-1 attention case of bench_decode_kernels (queries, pages, caches)."""
    import torch.nn.functional as F
    from slipstream.kernels.dense_gemv import dense_gemv
    from slipstream.kernels.short_decode_attention import short_decode_attention
    gen = torch.Generator(device=device).manual_seed(5)
    shapes = ({"qkv": (64, 4096), "o_proj": (64, 4096), "gate_up": (64, 4096), "down": (64, 128)}
              if smoke else GEMV_SHAPES)
    out = {"alone": [], "after_kernel": {}}
    for name, (n, k) in shapes.items():
        copies = 1 if smoke else max(1, min(8, math.ceil(256e6 / (n * k * 2))))
        ws = [(torch.randn(n, k, device=device, generator=gen) * 0.02).to(dtype) for _ in range(copies)]
        xs = [torch.randn(1, k, device=device, generator=gen).to(dtype) for _ in range(copies)]
        ref = F.linear(xs[0].float(), ws[0].float())
        row = {"name": name, "n": n, "k": k, "bytes": n * k * 2, "us": {}, "check": {}}
        for c in GEMV_CONFIGS:
            row["check"][c] = err(torch, dense_gemv(xs[0], ws[0], config=_gemv_cfg(c)), ref, 1e-2)
        row["us"]["cublas"] = timer([lambda x=x, w=w: F.linear(x, w) for x, w in zip(xs, ws)]) * 1e3
        for c in GEMV_CONFIGS:
            row["us"][c] = timer([lambda x=x, w=w, c=c: dense_gemv(x, w, config=_gemv_cfg(c))
                                   for x, w in zip(xs, ws)]) * 1e3
        row["TBps"] = {key: row["bytes"] / (v * 1e-6) / 1e12 for key, v in row["us"].items()}
        out["alone"].append(row)
        print(f"  gemv {name}: " + ", ".join(f"{key} {v:.1f} us ({row['TBps'][key]:.2f} TB/s)"
                                            for key, v in row["us"].items()), flush=True)
        del ws, xs
    # Each weight after the kernel that precedes it in a decode step (batch 1), which
    # lets a GEMV launch early: old cuBLAS; new the GEMV, with and without L2 prefetch.
    from slipstream.kernels.rms_norm import rms_norm
    from slipstream.kernels.silu_mul import silu_and_mul
    ctx = 40 if smoke else 256
    copies = 1 if smoke else 4
    s = setup(ctx, copies)
    hidden = HEADS * HEAD_DIM
    norm_w = torch.ones(hidden, device=device, dtype=dtype)
    res = {}
    for name, (n, k) in shapes.items():
        ws = [(torch.randn(n, k, device=device, generator=gen) * 0.02).to(dtype)
              for _ in range(copies)]
        ins = [torch.randn(1, 2 * k if name == "down" else hidden, device=device,
                           generator=gen).to(dtype) for _ in range(copies)]
        best = min(GEMV_CONFIGS, key=lambda c: next(
            r for r in out["alone"] if r["name"] == name)["us"][c])

        def before(i, d, name=name):
            if name == "o_proj":
                return short_decode_attention(d["q"], s["kc"], s["vc"], s["seq_lens"], d["tables"],
                                              HEAD_DIM ** -0.5, out=d["out"],
                                              config={"TRIGGER": True}).view(1, -1)
            if name == "down":
                return silu_and_mul(ins[i])
            if name == "gate_up":
                return rms_norm(ins[i], norm_w, 1e-5, residual=ins[i])[0]
            return rms_norm(ins[i], norm_w, 1e-5)

        def chain(i, d, how, prefetch, best=best, before=before):
            def call():
                x = before(i, d)
                if how == "alone":
                    return x
                if how == "cublas":
                    return F.linear(x, ws[i])
                return dense_gemv(x, ws[i], config=_gemv_cfg(best, prefetch))
            return call
        row = {"gemv_config": best, "before": {"o_proj": "attention", "down": "silu_mul",
                                               "gate_up": "add_rms_norm"}.get(name, "rms_norm")}
        for how, pf in (("alone", 0), ("cublas", 0), ("gemv", 0), ("gemv_prefetch1k", 1024),
                        ("gemv_prefetch_all", k)):
            row[how] = timer([chain(i, d, how.split("_")[0], pf)
                               for i, d in enumerate(s["data"])]) * 1e3
        res[name] = row
        print(f"  {row['before']} + {name}: {row}", flush=True)
        del ws, ins
    out["after_kernel"] = res
    return out

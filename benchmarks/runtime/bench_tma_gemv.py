"""The batch-1 TMA GEMV (kernels/tma_gemv.py) against cuBLAS, alone and inside a decode layer.

    python benchmarks/runtime/bench_tma_gemv.py --out DIR [--commit SHA]    # H100/H200

Llama-3-8B weights, bf16, one row. In one run:
1. Correctness: the GEMV against F.linear in fp32 at every shape; with the RMSNorm
   folded in (with and without the residual add) against its twin: the residual
   stream it writes bit-equal, the product within bf16 rounding; a CUDA-graph
   replay of the chained launches equal to the eager run.
2. The copy bandwidth, measured in this run.
3. Alone: cuBLAS (F.linear) against the GEMV in several launch configs.
4. A decode layer's kernels at batch 1, each side in one CUDA graph over 4 copies
   of the weights: cuBLAS with the norm kernels (the engine today) against the
   GEMV with the norms folded in, launched early (programmatic dependent launch).
   The layer's attention (short-context kernel, 256-token context) is in both;
   rotary and KV store are left out of both.
Times: median us per call over CUDA-graph replays, weights streamed from HBM.
Writes DIR/tma_gemv.json and DIR/tma_gemv.md.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT), str(HERE)]

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336), "lm_head": (128256, 4096)}
# (BLOCK_N, BLOCK_K, STAGES, warps, programs a SM: 0 = one a row block)
CONFIGS = {"N16K256s4": (16, 256, 4, 4, 0), "N16K256s6": (16, 256, 6, 4, 0),
           "N32K128s6": (32, 128, 6, 4, 0), "N16K256s4p2": (16, 256, 4, 4, 2),
           "N16K256s6p2": (16, 256, 6, 4, 2), "N8K256s6p3": (8, 256, 6, 4, 3),
           "N16K256s8p1": (16, 256, 8, 4, 1), "N32K256s4w8p1": (32, 256, 4, 8, 1),
           "N16K256s3": (16, 256, 3, 4, 0), "N32K256s4w8": (32, 256, 4, 8, 0)}
EPS = 1e-5


def cfg(name):
    bn, bk, st, w, p = CONFIGS[name]
    return {"BLOCK_N": bn, "BLOCK_K": bk, "STAGES": st, "num_warps": w, "PROGRAMS": p}


def rel_err(got, want):
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def correctness(torch, F, dev):
    from slipstream.kernels.rms_norm import rms_norm
    from slipstream.kernels.tma_gemv import reference, tma_gemv
    gen = torch.Generator(device=dev).manual_seed(0)
    out = {}
    for name, (n, k) in SHAPES.items():
        w = (torch.randn(n, k, device=dev, generator=gen) * 0.02).bfloat16()
        x = torch.randn(1, k, device=dev, generator=gen).bfloat16()
        ref = F.linear(x.float(), w.float())
        for c in CONFIGS:
            e = rel_err(tma_gemv(x, w, config=cfg(c)), ref)
            out[f"{name}_{c}"] = {"rel_err": e, "ok": e < 1e-2}
        if k == 4096:  # the norm folded in: the layer's norms run over the hidden size
            r = torch.randn(1, k, device=dev, generator=gen).bfloat16()
            g = (1 + 0.1 * torch.randn(k, device=dev, generator=gen)).bfloat16()
            for add in (False, True):
                ro = torch.empty_like(x)
                y = tma_gemv(x, w, norm_weight=g, eps=EPS, residual=r if add else None,
                             residual_out=ro if add else None, chain=True)
                want, s = reference(x, w, norm_weight=g, eps=EPS, residual=r if add else None)
                normed = rms_norm(x, g, EPS, residual=r)[0] if add else rms_norm(x, g, EPS)
                engine = F.linear(normed, w)   # the engine's path today
                e = rel_err(y, want.float())
                ok = e < 1e-2 and rel_err(y, engine) < 1e-2
                if add:
                    ok = ok and bool(torch.equal(ro, s))
                out[f"{name}_norm{'_add' if add else ''}"] = {"rel_err": e, "ok": ok,
                                                              "rel_err_vs_engine": rel_err(y, engine)}
        if name == "down":  # silu(gate) * up folded in
            gu = torch.randn(1, 2 * k, device=dev, generator=gen).bfloat16()
            y = tma_gemv(gu, w, silu_mul=True, chain=True)
            want, _ = reference(gu, w, silu_mul=True)
            from slipstream.kernels.silu_mul import silu_and_mul
            engine = F.linear(silu_and_mul(gu), w)
            e = rel_err(y, want.float())
            out["down_silu_mul"] = {"rel_err": e, "ok": e < 1e-2 and rel_err(y, engine) < 1e-2,
                                    "rel_err_vs_engine": rel_err(y, engine)}
    # a graph of chained launches replays as it ran eagerly
    n, k = SHAPES["qkv"]
    w = (torch.randn(n, k, device=dev, generator=gen) * 0.02).bfloat16()
    w2 = (torch.randn(k, n, device=dev, generator=gen) * 0.02).bfloat16()
    x = torch.randn(1, k, device=dev, generator=gen).bfloat16()
    g = torch.ones(k, device=dev).bfloat16()
    r, ro, y1, y2 = torch.randn_like(x), torch.empty_like(x), torch.empty(1, n, device=dev).bfloat16(), \
        torch.empty_like(x)

    def chain():
        tma_gemv(x, w, norm_weight=g, eps=EPS, residual=r, residual_out=ro, out=y1, chain=True)
        tma_gemv(y1, w2, out=y2, chain=True)
    chain()
    torch.cuda.synchronize()
    eager = y2.clone()
    y2.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    graph.replay()
    torch.cuda.synchronize()
    out["graph_replay_equal"] = {"ok": bool(torch.equal(eager, y2))}
    return out


def alone(torch, F, dev, timer):
    from slipstream.kernels.tma_gemv import tma_gemv
    gen = torch.Generator(device=dev).manual_seed(1)
    rows = []
    for name, (n, k) in SHAPES.items():
        copies = max(1, min(8, math.ceil(256e6 / (n * k * 2))))
        ws = [(torch.randn(n, k, device=dev, generator=gen) * 0.02).bfloat16() for _ in range(copies)]
        xs = [torch.randn(1, k, device=dev, generator=gen).bfloat16() for _ in range(copies)]
        row = {"name": name, "n": n, "k": k, "bytes": n * k * 2, "us": {}}
        row["us"]["cublas"] = timer([lambda x=x, w=w: F.linear(x, w) for x, w in zip(xs, ws)]) * 1e3
        for c in CONFIGS:
            row["us"][c] = timer([lambda x=x, w=w, c=c: tma_gemv(x, w, config=cfg(c))
                                  for x, w in zip(xs, ws)]) * 1e3
        rows.append(row)
        print(f"  {name}: " + ", ".join(f"{key} {v:.1f}" for key, v in row["us"].items()), flush=True)
        del ws, xs
    return rows


def layer(torch, F, dev, timer, best):
    """One decode layer's kernels at batch 1 (no rotary / KV store), 4 copies of the weights."""
    from decode_kernel_cases import RUN, setup_case
    from slipstream.kernels.rms_norm import rms_norm
    from slipstream.kernels.short_decode_attention import short_decode_attention
    from slipstream.kernels.silu_mul import silu_and_mul
    from slipstream.kernels.tma_gemv import tma_gemv
    RUN.dtype, RUN.sms = torch.bfloat16, torch.cuda.get_device_properties(0).multi_processor_count
    copies = 4
    s = setup_case(torch, 1, 256, "bf16", dev, copies)
    gen = torch.Generator(device=dev).manual_seed(2)
    hidden = 4096

    def rnd(*shape, scale=0.02):
        return (torch.randn(*shape, device=dev, generator=gen) * scale).bfloat16()
    W = [{name: rnd(n, k) for name, (n, k) in SHAPES.items() if name != "lm_head"} for _ in range(copies)]
    g1, g2 = [rnd(hidden, scale=1) for _ in range(2)]
    bufs = [dict(x=rnd(1, hidden, scale=1), r=rnd(1, hidden, scale=1), r1=torch.empty(1, hidden, device=dev).bfloat16(),
                 r2=torch.empty(1, hidden, device=dev).bfloat16(),
                 qkv=torch.empty(1, 6144, device=dev).bfloat16(), o=torch.empty(1, hidden, device=dev).bfloat16(),
                 gu=torch.empty(1, 28672, device=dev).bfloat16(), down=torch.empty(1, hidden, device=dev).bfloat16())
            for _ in range(copies)]

    def attention(d):
        return short_decode_attention(d["q"], s["kc"], s["vc"], s["seq_lens"], d["tables"],
                                      128 ** -0.5, out=d["out"], config={"TRIGGER": True}).view(1, -1)

    def engine(i, gemv_for=()):
        w, b, d = W[i], bufs[i], s["data"][i]

        def lin(name, x, out):
            if name in gemv_for:
                return tma_gemv(x, w[name], out=out, chain=True, config=best.get(name))
            return torch.matmul(x, w[name].t(), out=out)

        def call():
            h, res = rms_norm(b["x"], g1, EPS, residual=b["r"])
            lin("qkv", h, b["qkv"])
            a = attention(d)
            lin("o_proj", a, b["o"])
            h, res = rms_norm(b["o"], g2, EPS, residual=res)
            lin("gate_up", h, b["gu"])
            lin("down", silu_and_mul(b["gu"]), b["down"])
        return call

    def fused(i, cublas_gate_up=False, fold_silu=False):
        w, b, d = W[i], bufs[i], s["data"][i]

        def call():
            tma_gemv(b["x"], w["qkv"], norm_weight=g1, eps=EPS, residual=b["r"], residual_out=b["r1"],
                     out=b["qkv"], chain=True, config=best.get("qkv"))
            a = attention(d)
            tma_gemv(a, w["o_proj"], out=b["o"], chain=True, config=best.get("o_proj"))
            if cublas_gate_up:
                h, _ = rms_norm(b["o"], g2, EPS, residual=b["r1"])
                torch.matmul(h, w["gate_up"].t(), out=b["gu"])
            else:
                tma_gemv(b["o"], w["gate_up"], norm_weight=g2, eps=EPS, residual=b["r1"],
                         residual_out=b["r2"], out=b["gu"], chain=True, config=best.get("gate_up"))
            if fold_silu:
                tma_gemv(b["gu"], w["down"], silu_mul=True, out=b["down"], chain=True,
                         config=best.get("down"))
            else:
                tma_gemv(silu_and_mul(b["gu"]), w["down"], out=b["down"], chain=True,
                         config=best.get("down"))
        return call

    variants = {
        "cublas + norm kernels (engine)": [engine(i) for i in range(copies)],
        "gemv for qkv, o_proj, down; norm kernels": [engine(i, ("qkv", "o_proj", "down")) for i in range(copies)],
        "gemv, norms folded in": [fused(i) for i in range(copies)],
        "gemv, norms folded in, cublas gate_up": [fused(i, True) for i in range(copies)],
        "gemv, norms and silu folded in": [fused(i, fold_silu=True) for i in range(copies)],
        "attention alone": [lambda d=d: attention(d) for d in s["data"]],
    }
    res = {}
    for name, calls in variants.items():
        res[name] = timer(calls) * 1e3
        print(f"  layer, {name}: {res[name]:.1f} us", flush=True)
    res["weights_bytes"] = sum(n * k * 2 for name, (n, k) in SHAPES.items() if name != "lm_head")
    return res


def markdown(res) -> str:
    m = res["meta"]
    bw = res["copy_GBps"] * 1e9
    lines = [f"# Batch-1 TMA GEMV against cuBLAS ({m['device']}, {m['date_utc']})", "",
             f"torch {m['torch']}, triton {m['triton']}, commit {m['commit']}; copy bandwidth "
             f"{res['copy_GBps']:.0f} GB/s (this run). Correctness: "
             f"{'all ok' if all(v['ok'] for v in res['correctness'].values()) else 'FAILED'}.", "",
             "## Alone (us per call; % of copy bandwidth for the weight's bytes)", "",
             "| weight | N x K | cuBLAS | best GEMV | config | speedup |", "| --- | --- | ---: | ---: | --- | ---: |"]
    for r in res["alone"]:
        best = min((c for c in r["us"] if c != "cublas"), key=r["us"].get)
        pct = lambda us: 100 * r["bytes"] / (us * 1e-6) / bw  # noqa: E731
        lines.append(f"| {r['name']} | {r['n']} x {r['k']} | {r['us']['cublas']:.1f} ({pct(r['us']['cublas']):.0f}%) | "
                     f"{r['us'][best]:.1f} ({pct(r['us'][best]):.0f}%) | {best} | "
                     f"{r['us']['cublas'] / r['us'][best]:.2f}x |")
    L = res["layer"]
    ideal = L["weights_bytes"] / bw * 1e6
    lines += ["", f"## A decode layer's kernels at batch 1 (weights {L['weights_bytes'] / 1e6:.0f} MB: "
              f"{ideal:.1f} us at copy bandwidth)", "", "| variant | us per layer | weights at copy BW / time |",
              "| --- | ---: | ---: |"]
    for k, v in L.items():
        if k != "weights_bytes":
            lines.append(f"| {k} | {v:.1f} | {100 * ideal / v:.0f}% |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--commit", default="unknown")
    args = ap.parse_args()
    import torch
    import torch.nn.functional as F
    import triton
    from benchmarks.cuda_timing import graph_timer
    from slipstream.analysis.hardware import measure_copy_bandwidth
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        sys.exit("needs an sm_90 GPU (H100/H200)")
    dev = "cuda"
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()

    def timer(calls):
        return graph_timer(calls, min_calls=64, replays=10)()
    res = {"meta": {"device": torch.cuda.get_device_name(),
                    "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "torch": torch.__version__, "triton": triton.__version__, "commit": args.commit}}
    res["correctness"] = correctness(torch, F, dev)
    for k, v in res["correctness"].items():
        if not v["ok"] or "norm" in k or "graph" in k or "silu" in k:
            print(f"  {k}: {v}", flush=True)
    res["copy_GBps"] = measure_copy_bandwidth(dev) / 1e9
    print(f"copy bandwidth {res['copy_GBps']:.0f} GB/s [{time.time() - t0:.0f}s]", flush=True)
    res["alone"] = alone(torch, F, dev, timer)
    best = {r["name"]: cfg(min((c for c in r["us"] if c != "cublas"), key=r["us"].get))
            for r in res["alone"]}
    print(f"layer [{time.time() - t0:.0f}s]", flush=True)
    res["layer"] = layer(torch, F, dev, timer, best)
    (args.out / "tma_gemv.json").write_text(json.dumps(res, indent=1))
    (args.out / "tma_gemv.md").write_text(markdown(res))
    print(markdown(res))
    ok = all(v["ok"] for v in res["correctness"].values())
    print(f"correctness {'ok' if ok else 'FAILED'}; {time.time() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()

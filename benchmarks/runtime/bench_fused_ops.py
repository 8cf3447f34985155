"""Fused elementwise kernels on the GPU, in one run: correctness, speed, launches.

    python benchmarks/runtime/bench_fused_ops.py [--out DIR] [--commit SHA]
    python benchmarks/runtime/bench_fused_ops.py --smoke      # CPU, TRITON_INTERPRET=1, tiny shapes

1. bf16 correctness of every fused kernel (add + RMSNorm, RMSNorm, SiLU * up,
   in-place rotary on the qkv view) against its torch twin in kernels/reference.py;
2. the device-to-device copy bandwidth, measured in this run;
3. each kernel against the unfused torch ops it replaces (the layers' CPU
   path) at decode (1..256 tokens) and prefill (2k..8k tokens) sizes of a
   Llama-3-8B layer (hidden 4096, inter 14336, 32/8 heads, head_dim 128):
   time per call (both sides replayed from a CUDA graph, so launch overhead is
   out of both), GB/s of the bytes each must move and % of the copy bandwidth;
4. kernel launches per decoder layer in a decode step of a small random Llama
   run through the model code (torch.profiler; counted as the difference
   between a 4-layer and a 2-layer model, halved), fused and unfused.
Writes DIR/fused_ops.json and DIR/fused_ops.md (default benchmarks/runtime/results).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT), str(HERE)]

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 4096, 14336, 32, 8, 128
DECODE_TOKENS = (1, 8, 32, 64, 128, 256)
PREFILL_TOKENS = (2048, 4096, 8192)
# bf16: two units in the last place (2^-7 relative) plus a small absolute floor.
BF16_TOL = dict(atol=2e-2, rtol=1.6e-2)


def _graph_timer(fn, reps: int = 20, replays: int = 15):
    """Median ms per call of `fn` captured `reps` times in one CUDA graph."""
    from benchmarks.cuda_timing import graph_timer
    return graph_timer([fn], reps, replays)()


def _cpu_timer(fn, reps: int = 2):
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps * 1e3


def _cases(torch, device, dtype, shape):
    """name -> (fused fn, unfused fn, bytes moved) for one token count."""
    from slipstream.kernels import reference
    from slipstream.kernels.rms_norm import rms_norm
    from slipstream.kernels.rotary import rotary_inplace
    from slipstream.kernels.silu_mul import silu_and_mul
    from slipstream.layers.rotary import RotaryEmbedding
    n, hidden, inter, heads, kv, hd = shape
    e = torch.empty((), dtype=dtype).element_size()
    g = torch.Generator(device=device).manual_seed(n)
    x = torch.randn(n, hidden, device=device, generator=g).to(dtype)
    res = torch.randn(n, hidden, device=device, generator=g).to(dtype)
    w = (torch.rand(hidden, device=device, generator=g) + 0.5).to(dtype)
    gu = torch.randn(n, 2 * inter, device=device, generator=g).to(dtype)
    qkv = torch.randn(n, heads + 2 * kv, hd, device=device, generator=g).to(dtype)
    pos = torch.randint(0, 8192, (n,), device=device, generator=g)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            rope = RotaryEmbedding(hd, 8192, 500000.0)
    finally:
        torch.set_default_dtype(old)
    qk = qkv[:, :heads + kv]
    # The unfused path gathers cos/sin rows once a step (not timed: shared by all
    # layers), then each layer builds new rotated heads from them.
    from slipstream.layers.rotary import apply_rotary
    c, s = rope.lookup(pos)

    def torch_rotary():
        return apply_rotary(qk, c, s)

    return {
        "add_rms_norm": (lambda: rms_norm(x, w, 1e-5, res), lambda: reference.rms_norm(x, w, 1e-5, res),
                         (4 * n * hidden + hidden) * e),
        "rms_norm": (lambda: rms_norm(x, w, 1e-5), lambda: reference.rms_norm(x, w, 1e-5),
                     (2 * n * hidden + hidden) * e),
        "silu_mul": (lambda: silu_and_mul(gu), lambda: reference.silu_and_mul(gu), 3 * n * inter * e),
        # in place: q and k heads read and written, cos/sin half rows and positions read
        "rotary": (lambda: rotary_inplace(qk, pos, rope.cos, rope.sin), torch_rotary,
                   2 * n * (heads + kv) * hd * e + n * hd * e + n * 8),
    }, (x, res, w, gu, qkv, pos, rope)


def correctness(torch, device, dtype, shape) -> dict:
    """Max abs error and pass/fail of every fused kernel against its twin."""
    from slipstream.kernels import reference
    from slipstream.kernels.rotary import rotary_inplace
    cases, (x, res, w, gu, qkv, pos, rope) = _cases(torch, device, dtype, shape)
    heads, kv = shape[3], shape[4]
    tol = BF16_TOL if dtype == torch.bfloat16 else dict(atol=2e-3, rtol=2e-3)
    out = {}
    for name in ("add_rms_norm", "rms_norm", "silu_mul"):
        fused, unfused, _ = cases[name]
        got, want = fused(), unfused()
        if name == "add_rms_norm":
            out["add_rms_norm.residual_exact"] = bool(torch.equal(got[1], want[1]))
            got, want = got[0], want[0]
        out[name] = _compare(torch, got, want, tol)
    a, b = qkv.clone(), qkv.clone()
    rotary_inplace(a[:, :heads + kv], pos, rope.cos, rope.sin)
    reference.rotary_inplace(b[:, :heads + kv], pos, rope.cos, rope.sin)
    out["rotary"] = _compare(torch, a, b, tol)
    out["rotary.v_untouched"] = bool(torch.equal(a[:, heads + kv:], qkv[:, heads + kv:]))
    return out


def graph_safety(torch, device, dtype, shape) -> dict:
    """Each fused kernel launched with host syncs turned into errors, then
    captured in a CUDA graph and replayed: the replay's output equals the eager one."""
    cases, (_, _, _, _, qkv, _, _) = _cases(torch, device, dtype, shape)
    start = qkv.clone()   # rotary works in place on qkv: each run starts from here

    def run(fn):
        qkv.copy_(start)
        out = fn()
        return (qkv.clone(),) if out is None or out.data_ptr() == qkv.data_ptr() else \
            (out if isinstance(out, tuple) else (out,))

    out = {}
    for name, (fused, _, _) in cases.items():
        torch.cuda.set_sync_debug_mode("error")
        try:
            eager = run(fused)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        qkv.copy_(start)
        with torch.cuda.graph(g):
            captured = fused()
        qkv.copy_(start)
        g.replay()
        torch.cuda.synchronize()
        if name == "rotary":
            captured = (qkv,)
        elif not isinstance(captured, tuple):
            captured = (captured,)
        out[name] = all(bool(torch.equal(a, b)) for a, b in zip(eager, captured))
    return out


def _compare(torch, got, want, tol) -> dict:
    err = (got.float() - want.float()).abs().max().item()
    try:
        torch.testing.assert_close(got, want, **tol)
        ok = True
    except AssertionError:
        ok = False
    return {"max_abs_err": err, "ok": ok and not got.isnan().any().item()}


def timing(torch, device, dtype, shape, copy_bw: float, smoke: bool) -> dict:
    cases, _ = _cases(torch, device, dtype, shape)
    timer = _cpu_timer if smoke else _graph_timer
    rows = {}
    for name, (fused, unfused, nbytes) in cases.items():
        f_ms, u_ms = timer(fused), timer(unfused)
        rows[name] = {"fused_us": f_ms * 1e3, "torch_us": u_ms * 1e3, "speedup": u_ms / f_ms,
                      "fused_GBps": nbytes / (f_ms * 1e-3) / 1e9,
                      "torch_GBps": nbytes / (u_ms * 1e-3) / 1e9,
                      "fused_pct_copy_bw": 100 * nbytes / (f_ms * 1e-3) / copy_bw,
                      "bytes": nbytes}
    return rows


def markdown(res: dict) -> str:
    m = res["meta"]
    lines = [f"# Fused elementwise kernels ({m['device']}, {m['dtype']})", "",
             f"{m['date_utc']}, commit {m['commit']}, torch {m['torch']}, triton {m['triton']}. "
             f"Copy bandwidth measured in this run: {res['copy_GBps']:.1f} GB/s "
             "(bytes read + written). Times: median per call, both sides replayed from "
             "a CUDA graph (launch overhead excluded from both). At decode sizes the "
             "data fits in L2 and is re-read every call, so GB/s there is not an HBM "
             "figure: the time per call is what counts; at prefill sizes the data "
             "streams from HBM.", "",
             "## Correctness against the torch twins", "",
             "| check | max abs err | ok |", "| --- | ---: | --- |"]
    for k, v in res["correctness"].items():
        if isinstance(v, dict):
            lines.append(f"| {k} | {v['max_abs_err']:.2e} | {v['ok']} |")
        else:
            lines.append(f"| {k} | | {v} |")
    shape = ", ".join(f"{k} {v}" for k, v in m["shape"].items())
    gs = res.get("graph_safety")
    if gs:
        lines += ["", "No host sync (`set_sync_debug_mode('error')`), and a CUDA-graph replay "
                  "equals the eager call: " + ", ".join(f"{k} {v}" for k, v in gs.items()) + "."]
    mp = res.get("model_fp32")
    if mp:
        lines += ["", f"Small random Llama, fp32 decode step, fused against torch ops: max |logit "
                  f"diff| {mp['max_abs_logit_diff']:.2e} (logit std {mp['logit_std']:.2f}), "
                  f"ok: {mp['ok']}."]
    lines += ["", f"## Speed ({shape})", "",
              "| op | tokens | fused us | torch us | speed-up | fused GB/s | % of copy BW |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for n, rows in res["timing"].items():
        for op, r in rows.items():
            lines.append(f"| {op} | {n} | {r['fused_us']:.1f} | {r['torch_us']:.1f} | "
                         f"{r['speedup']:.2f}x | {r['fused_GBps']:.0f} | {r['fused_pct_copy_bw']:.0f}% |")
    lines += ["", "## Kernel launches per decoder layer (decode step, batch 8, small random "
              "Llama through the model code, triton attention)", ""]
    for k, v in res["launches"].items():
        lines.append(f"- {k}: {v.get('per_layer')}")
    names = res["launches"].get("fused", {}).get("layer_kernels")
    if names:
        lines += ["", "Kernels of one fused layer: " + ", ".join(f"`{n[:60]}`" for n in names)]
    return "\n".join(lines) + "\n"


def main() -> None:
    from small_model import launches_per_layer, model_parity
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU dry run under TRITON_INTERPRET=1 with tiny shapes")
    ap.add_argument("--commit", default="unknown")
    args = ap.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"   # before triton is first imported
    import torch
    import triton
    from slipstream.analysis.hardware import measure_copy_bandwidth

    if not args.smoke and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --smoke for a CPU dry run")
    device = "cpu" if args.smoke else "cuda"
    # The interpreter cannot do bf16 arithmetic: the smoke run checks fp16.
    dtype = torch.float16 if args.smoke else torch.bfloat16
    big = (HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM)
    dims = (64, 96, 4, 2, 16) if args.smoke else big
    decode, prefill = ((1, 3), (17,)) if args.smoke else (DECODE_TOKENS, PREFILL_TOKENS)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()

    def log(msg):
        print(f"[{time.time() - t0:6.1f}s] {msg}", flush=True)

    res = {"meta": {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke)",
        "dtype": str(dtype).replace("torch.", ""), "shape": dict(zip(
            ("hidden", "inter", "heads", "kv_heads", "head_dim"), dims)),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__, "triton": triton.__version__, "commit": args.commit}}
    log("correctness")
    res["correctness"] = correctness(torch, device, dtype, (37,) + dims)
    log(f"  {res['correctness']}")
    if device == "cuda":
        res["graph_safety"] = graph_safety(torch, device, dtype, (37,) + dims)
        log(f"  no host sync, graph replay equals eager: {res['graph_safety']}")
    res["model_fp32"] = model_parity(torch, device)
    log(f"  model fp32 fused vs torch: {res['model_fp32']}")
    res["copy_GBps"] = measure_copy_bandwidth(device, nbytes=1 << 20 if args.smoke else None) / 1e9
    log(f"copy bandwidth {res['copy_GBps']:.0f} GB/s")
    res["timing"] = {}
    for n in (*decode, *prefill):
        res["timing"][n] = timing(torch, device, dtype, (n,) + dims, res["copy_GBps"] * 1e9, args.smoke)
        log(f"tokens {n}: " + ", ".join(f"{k} {v['fused_us']:.1f}us ({v['speedup']:.2f}x)"
                                        for k, v in res["timing"][n].items()))
    res["launches"] = {}
    for fused in (True, False):
        key = "fused" if fused else "unfused"
        res["launches"][key] = launches_per_layer(torch, device, dtype, fused, args.smoke)
        log(f"launches per layer, {key}: {res['launches'][key]['per_layer']}")
    (args.out / "fused_ops.json").write_text(json.dumps(res, indent=1))
    (args.out / "fused_ops.md").write_text(markdown(res))
    ok = all(v["ok"] if isinstance(v, dict) else v for v in res["correctness"].values())
    ok = ok and res["model_fp32"]["ok"] and all(res.get("graph_safety", {}).values())
    log(f"wrote {args.out}/fused_ops.json and .md; correctness {'ok' if ok else 'FAILED'}")
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()

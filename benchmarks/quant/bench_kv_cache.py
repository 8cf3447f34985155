"""Quantized KV cache on the GPU: correctness, then decode attention and a model
decode step with int8 / fp8 KV against the bf16 KV cache (H200, about 2 minutes).

1. Correctness (bf16 activations, Llama-3-8B heads: GQA 32/8, head_dim 128): the
   KV-store kernel against `reference.store_kv` (same scales, codes equal up to
   rounding ties), and the decode, tree and paged-prefill kernels reading int8 /
   fp8 codes against their twins in kernels/reference.py (dequantized in fp32);
   plus the error the quantization itself adds (against attention over the exact
   bf16 K/V). Timing runs only if every check passes.
2. Decode attention (split-KV FlashDecoding kernel), batch 1 at 32k context and
   batch 32 at 4k, paged cache (16-token pages, randomly permuted), timed in CUDA
   graphs over enough data copies that every call streams from HBM: microseconds,
   bytes moved (codes + scales), share of the copy bandwidth measured in the same
   run, and the speedup over the bf16 cache. The engine's launch config is timed
   first; then a sweep of tile configs and split counts for the 1-byte caches
   (the engine's defaults for them were chosen from the compiled code, not timed).
3. Model decode step (skip with --skip-model): Llama-3-8B shape, random bf16
   weights, one token per sequence (batch 1 at 32k context, batch 32 at 4k), the
   whole forward captured in a CUDA graph, per KV cache dtype: tokens/s.

    python benchmarks/quant/bench_kv_cache.py [--out DIR]            # H200
    python benchmarks/quant/bench_kv_cache.py --smoke --out /tmp/kv  # CPU, interpreter, tiny shapes
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:   # before triton is imported anywhere
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from slipstream.kernels import reference  # noqa: E402
from slipstream.kernels.decode_attention import (  # noqa: E402
    choose_num_splits, decode_attention, split_kv_scratch)
from slipstream.kernels.kv_store import store_kv  # noqa: E402
from slipstream.kernels.prefill_attention import prefill_attention  # noqa: E402
from slipstream.kernels.tree_attention import ancestor_mask, tree_attention  # noqa: E402
from slipstream.quant.kv_quant import KV_FORMATS  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
SCALE = HEAD_DIM ** -0.5
L2_BYTES = 256 << 20
KINDS = ("bf16", "int8", "fp8")
# (BLOCK_N, num_warps, num_stages) tried for the 1-byte caches; split factors
# around the automatic count.
SWEEP = [(64, 2, 4), (64, 2, 6), (64, 4, 6), (128, 4, 4), (128, 4, 6), (128, 4, 8)]
SPLIT_FACTORS = (0.5, 1.0, 2.0)
ERR_LIMIT = {"twin": 2e-2, "store_scale": 1e-5}


def make_timer(calls, smoke):
    """A function giving ms per call: CUDA-graph replays on the GPU
    (benchmarks/cuda_timing.py); on the CPU (--smoke) one wall-clock pass, so that
    every code path runs (the figures mean nothing there)."""
    if not smoke:
        from benchmarks.cuda_timing import graph_timer
        return graph_timer(calls)

    def wall():
        t = time.perf_counter()
        for c in calls:
            c()
        return (time.perf_counter() - t) * 1e3 / len(calls)
    return wall


def rel_err(out, ref) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm()).item()


def paged(k, v, gen):
    """Contiguous K/V [B, L, Hkv, D] -> (k_cache, v_cache, tables) in permuted pages."""
    b, length, hkv, d = k.shape
    pages = length // PAGE
    perm = torch.randperm(b * pages, generator=gen).to(k.device)
    kc = torch.empty(b * pages, PAGE, hkv, d, dtype=k.dtype, device=k.device)
    vc = torch.empty_like(kc)
    kc[perm] = k.reshape(b * pages, PAGE, hkv, d)
    vc[perm] = v.reshape(b * pages, PAGE, hkv, d)
    return kc, vc, perm.view(b, pages).to(torch.int32)


def quantize_cache(cache, kind):
    """[blocks, page, heads, dim] -> (codes, scales [blocks, page, heads] fp32)."""
    if kind == "bf16":
        return cache, None
    fmt = KV_FORMATS[kind]
    codes = torch.empty(cache.shape, dtype=fmt.storage, device=cache.device)
    scales = torch.empty(cache.shape[:3], dtype=torch.float32, device=cache.device)
    for i in range(0, cache.shape[0], 4096):   # chunks: the fp32 temporaries stay small
        c, s = fmt.quantize(cache[i:i + 4096].flatten(0, 1))
        codes[i:i + 4096] = c.view(codes[i:i + 4096].shape)
        scales[i:i + 4096] = s.view(scales[i:i + 4096].shape)
    return codes, scales


# --- 1. correctness ----------------------------------------------------------------

def correctness(device, dtype, log, smoke=False) -> dict:
    gen = torch.Generator().manual_seed(0)
    res = {}
    # KV store: a step of 37 tokens into scattered slots.
    k = (torch.randn(37, KV_HEADS, HEAD_DIM, generator=gen) * 3).to(device, dtype)
    v = torch.randn(37, KV_HEADS, HEAD_DIM, generator=gen).to(device, dtype)
    slots = torch.randperm(64 * PAGE, generator=gen)[:37].to(device)
    slots[5] = -1
    for kind in ("int8", "fp8"):
        fmt = KV_FORMATS[kind]
        got, want = [], []
        for store, sink in ((store_kv, got), (reference.store_kv, want)):
            kc = torch.zeros(64, PAGE, KV_HEADS, HEAD_DIM, dtype=fmt.storage, device=device)
            vc = torch.zeros_like(kc)
            ks = torch.zeros(64, PAGE, KV_HEADS, device=device)
            vs = torch.zeros_like(ks)
            store(k, v, kc, vc, slots, ks, vs)
            sink += [kc, vc, ks, vs]
        scale_err = max(rel_err(got[i], want[i]) for i in (2, 3))
        code_diff = max((got[i].float() - want[i].float()).abs().gt(0).float().mean().item()
                        for i in (0, 1))
        res[f"store_{kind}"] = {"scale_rel_err": scale_err, "codes_differing": code_diff,
                                "ok": scale_err < ERR_LIMIT["store_scale"] and code_diff < 1e-3}
    # Decode / tree / prefill over a quantized paged cache, every slot holding random
    # K/V (pages for context + tree nodes; decode reads context + 1 of them).
    ctx, b, nodes = ([0, 20, 70, 33] if smoke else [0, 100, 2001, 517]), 4, 5
    lens = [c + 1 for c in ctx]
    blocks = [-(-(c + nodes) // PAGE) for c in ctx]
    num_blocks = sum(blocks) + 2
    tables = torch.zeros(b, max(blocks), dtype=torch.int32)
    perm = torch.randperm(num_blocks, generator=gen)
    used = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = perm[used:used + n]
        used += n
    kc = (torch.randn(num_blocks, PAGE, KV_HEADS, HEAD_DIM, generator=gen)
          * torch.rand(num_blocks, PAGE, KV_HEADS, 1, generator=gen) * 4).to(device, dtype)
    vc = torch.randn(num_blocks, PAGE, KV_HEADS, HEAD_DIM, generator=gen).to(device, dtype)
    tables = tables.to(device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    q = torch.randn(b, HEADS, HEAD_DIM, generator=gen).to(device, dtype)
    exact = reference.decode_attention(q.float(), kc.float(), vc.float(), seq_lens, tables, SCALE)
    tq = torch.randn(b * nodes, HEADS, HEAD_DIM, generator=gen).to(device, dtype)
    cu_tree = torch.arange(0, b * nodes + 1, nodes, dtype=torch.int32, device=device)
    tree_lens = torch.tensor([c + nodes for c in ctx], dtype=torch.int32, device=device)
    masks = ancestor_mask([-1, 0, 0, 1, 2]).expand(b, nodes, nodes).contiguous().to(device)
    pq = torch.randn(sum(ctx) // 8 + 30, HEADS, HEAD_DIM, generator=gen).to(device, dtype)
    for kind in ("int8", "fp8"):
        kq, ks = quantize_cache(kc, kind)
        vq, vs = quantize_cache(vc, kind)
        out = decode_attention(q, kq, vq, seq_lens, tables, SCALE, max_seq_len=max(lens),
                               k_scale=ks, v_scale=vs)
        twin = reference.decode_attention(q.float(), kq, vq, seq_lens, tables, SCALE,
                                          k_scale=ks, v_scale=vs)
        row = {"decode_vs_twin": rel_err(out, twin), "decode_vs_exact_bf16_kv": rel_err(out, exact)}
        tout = tree_attention(tq, kq, vq, cu_tree, tree_lens, tables, masks, SCALE,
                              max_query_len=nodes, max_seq_len=int(tree_lens.max()),
                              k_scale=ks, v_scale=vs)
        ttwin = reference.tree_attention(tq.float(), kq, vq, cu_tree, tree_lens, tables, masks,
                                         SCALE, k_scale=ks, v_scale=vs)
        row["tree_vs_twin"] = rel_err(tout, ttwin)
        # Prefill: chunks after each context, the context read from the codes.
        qlens = [pq.shape[0] // b] * b
        qlens[-1] += pq.shape[0] - sum(qlens)
        cu = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32,
                          device=device)
        pk = torch.randn(pq.shape[0], KV_HEADS, HEAD_DIM, generator=gen).to(device, dtype)
        pv = torch.randn_like(pk)
        ctx_t = torch.tensor(ctx, dtype=torch.int32, device=device)
        pout = prefill_attention(pq, pk, pv, kq, vq, cu, ctx_t, tables, max(qlens), SCALE,
                                 k_cache_scale=ks, v_cache_scale=vs)
        ptwin = reference.prefill_attention(pq.float(), pk.float(), pv.float(), kq, vq, cu, ctx_t,
                                            tables, SCALE, k_cache_scale=ks, v_cache_scale=vs)
        row["prefill_vs_twin"] = rel_err(pout, ptwin)
        row["ok"] = all(v < ERR_LIMIT["twin"] for n, v in row.items() if n.endswith("_twin"))
        res[kind] = row
        log(f"correctness {kind}: {row}")
    res["ok"] = all(r["ok"] for r in res.values() if isinstance(r, dict))
    return res


# --- 2. decode attention -------------------------------------------------------------

def decode_case(b, length, copy_bw, device, dtype, smoke, log) -> dict:
    gen = torch.Generator().manual_seed(b * 7 + length)
    bf16_bytes = 2 * b * length * KV_HEADS * HEAD_DIM * 2
    n = 1 if smoke else max(1, min(8, math.ceil(L2_BYTES / bf16_bytes)))
    data = []
    for _ in range(n):
        k = torch.randn(b, length, KV_HEADS, HEAD_DIM, device=device, dtype=dtype)
        v = torch.randn_like(k)
        kc, vc, tables = paged(k, v, gen)
        del k, v
        q = torch.randn(b, HEADS, HEAD_DIM, device=device, dtype=dtype)
        caches = {}
        for kind in KINDS:
            kq, ks = quantize_cache(kc, kind)
            vq, vs = quantize_cache(vc, kind)
            caches[kind] = (kq, vq, ks, vs)
        data.append((q, tables, caches))
    seq_lens = torch.full((b,), length, dtype=torch.int32, device=device)
    cu = torch.arange(b + 1, dtype=torch.int32, device=device)
    auto = choose_num_splits(b, KV_HEADS, length, group=HEADS // KV_HEADS)

    def calls(kind, splits, config=None):
        out = []
        for q, tables, caches in data:
            kq, vq, ks, vs = caches[kind]
            o = torch.empty_like(q)
            s = split_kv_scratch(b, HEADS, splits, HEAD_DIM, device) if splits > 1 else None
            out.append(lambda q=q, t=tables, kq=kq, vq=vq, ks=ks, vs=vs, o=o, s=s: decode_attention(
                q, kq, vq, seq_lens, t, SCALE, max_seq_len=length, num_splits=splits,
                cu_seqlens_q=cu, out=o, scratch=s, config=config, k_scale=ks, v_scale=vs))
        return out

    def nbytes(kind):
        if kind == "bf16":
            return bf16_bytes
        return 2 * b * length * KV_HEADS * (HEAD_DIM + 4)   # codes + fp32 scales

    row = {"B": b, "L": length, "copies": n, "splits_auto": auto}
    # Agreement of the three on the first copy (quantized vs bf16 cache).
    outs = {kind: calls(kind, auto)[0]() for kind in KINDS}
    for kind in ("int8", "fp8"):
        row[f"{kind}_rel_err_vs_bf16_kv"] = rel_err(outs[kind], outs["bf16"])
    timers = {kind: make_timer(calls(kind, auto), smoke) for kind in KINDS}
    times = {kind: [] for kind in KINDS}
    for _ in range(1 if smoke else 5):   # interleaved rounds: drift hits all alike
        for kind, t in timers.items():
            times[kind].append(t())
    med = {kind: sorted(ts)[len(ts) // 2] for kind, ts in times.items()}
    for kind in KINDS:
        ms = med[kind]
        row[kind] = {"us": ms * 1e3, "bytes": nbytes(kind),
                     "pct_copy_bw": 100 * nbytes(kind) / (ms * 1e-3) / copy_bw,
                     "speedup_vs_bf16": med["bf16"] / ms}
    log(f"  decode B={b} L={length}: " + ", ".join(
        f"{k} {row[k]['us']:.1f} us ({row[k]['pct_copy_bw']:.0f}% copy bw, "
        f"x{row[k]['speedup_vs_bf16']:.2f})" for k in KINDS))
    # Sweep: launch configs and split counts for the 1-byte caches.
    bf16_ms = med["bf16"]
    for kind in ("int8", "fp8"):
        sweep = {}
        factors = SPLIT_FACTORS[1:2] if smoke else SPLIT_FACTORS
        for splits in sorted({max(1, min(64, round(auto * f))) for f in factors}):
            for bn, w, st in (SWEEP[:1] + SWEEP[4:5]) if smoke else SWEEP:
                name = f"S{splits}_N{bn}_w{w}_s{st}"
                cfg = {"BLOCK_N": bn, "num_warps": w, "num_stages": st}
                try:
                    ms = make_timer(calls(kind, splits, cfg), smoke)()
                    sweep[name] = {"us": ms * 1e3, "pct_copy_bw": 100 * nbytes(kind) / (ms * 1e-3) / copy_bw,
                                   "speedup_vs_bf16": bf16_ms / ms}
                except Exception as e:   # e.g. out of shared memory
                    sweep[name] = {"error": f"{type(e).__name__}: {str(e)[:120]}"}
        best = max((r["speedup_vs_bf16"], n) for n, r in sweep.items() if "us" in r)
        row[f"{kind}_sweep"] = sweep
        row[f"{kind}_best"] = {"config": best[1], **sweep[best[1]]}
        log(f"    {kind} best: {best[1]} x{best[0]:.2f} ({sweep[best[1]]['pct_copy_bw']:.0f}% copy bw)")
    return row


# --- 3. model decode step ------------------------------------------------------------------

def model_step(cases, device, dtype, smoke, log) -> list[dict]:
    from dataclasses import replace

    from slipstream.attention.selector import create_backend
    from slipstream.batch import ForwardBatch
    from slipstream.config import ModelConfig, RopeScaling
    from slipstream.models.llama import LlamaForCausalLM
    if smoke:
        mc = ModelConfig("llama", 256, 256, 512, 2, 4, 2, 64, 1024)
    else:
        mc = ModelConfig("llama", 128256, 4096, 14336, 32, 32, 8, 128, 8192, 1e-5, 500000.0,
                         RopeScaling("llama3", 8.0, 1.0, 4.0, 8192))
        mc = replace(mc, max_position_embeddings=max(length for _, length in cases) + 16)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(mc, create_backend("triton", torch.device(device)), None)
    finally:
        torch.set_default_dtype(old)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02, generator=g)
    model.eval()
    rows = []
    for b, ctx in cases:
        blocks = -(-(ctx + 1) // PAGE)
        tables = torch.arange(b * blocks, dtype=torch.int32, device=device).view(b, blocks)
        batch = ForwardBatch(
            input_ids=torch.randint(0, 100, (b,), device=device),
            positions=torch.full((b,), ctx, dtype=torch.int64, device=device),
            query_start_loc=torch.arange(b + 1, dtype=torch.int32, device=device),
            seq_lens=torch.full((b,), ctx + 1, dtype=torch.int32, device=device),
            context_lens=torch.full((b,), ctx, dtype=torch.int32, device=device),
            slot_mapping=tables[:, ctx // PAGE].long() * PAGE + ctx % PAGE, block_tables=tables,
            logits_indices=torch.arange(b, device=device), max_query_len=1, max_seq_len=ctx + 1,
            query_lens_cpu=[1] * b, seq_lens_cpu=[ctx + 1] * b, num_decode_seqs=b)
        row = {"B": b, "context": ctx}
        ref_logits = None
        for kind in KINDS:
            torch.manual_seed(1)
            for layer in model.attention_layers():
                shape = (b * blocks, PAGE, mc.num_key_value_heads, mc.head_dim)
                kc, vc = (torch.randn(shape, device=device, dtype=dtype) for _ in range(2))
                layer.k_cache, layer.k_scale = quantize_cache(kc, kind)
                layer.v_cache, layer.v_scale = quantize_cache(vc, kind)
                del kc, vc
            with torch.inference_mode():
                model.backend.prepare(batch)
                run = lambda: model.compute_logits(model(batch)[batch.logits_indices])  # noqa: E731
                logits = run().float()
                ref_logits = logits if ref_logits is None else ref_logits
                cos = torch.nn.functional.cosine_similarity(logits, ref_logits, -1).min().item()
                if smoke:
                    ms = make_timer([run], smoke)()
                else:
                    for _ in range(2):
                        run()
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        run()
                    ts = []
                    for _ in range(20):
                        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        e0.record()
                        graph.replay()
                        e1.record()
                        e1.synchronize()
                        ts.append(e0.elapsed_time(e1))
                    ms = sorted(ts)[len(ts) // 2]
                    del graph
                row[kind] = {"ms": ms, "tokens_per_s": b / (ms * 1e-3), "logits_cosine_vs_bf16_kv": cos}
        for layer in model.attention_layers():
            layer.k_cache = layer.v_cache = layer.k_scale = layer.v_scale = None
        if device == "cuda":
            torch.cuda.empty_cache()
        for kind in KINDS:
            row[kind]["speedup_vs_bf16_kv"] = row["bf16"]["ms"] / row[kind]["ms"]
        log(f"  model step {row}")
        rows.append(row)
    return rows


def markdown(res) -> str:
    lines = ["# Quantized KV cache: decode attention and model decode step", "",
             f"{res['meta']['device']}; copy bandwidth {res['meta'].get('copy_GBps', 0):.0f} GB/s"
             f"{' (smoke run: CPU interpreter, tiny shapes, times meaningless)' if res['meta']['smoke'] else ''}. "
             "Llama-3-8B heads (GQA 32/8, head_dim 128), 16-token pages. int8 and fp8 (e4m3) "
             "hold 1-byte codes plus one fp32 scale per token and head.", "",
             f"Correctness: {'all checks pass' if res['correctness']['ok'] else 'FAILED'} "
             "(see JSON).", "",
             "## Decode attention (engine launch config)", "",
             "| B | context | KV | us | % copy bw | speedup vs bf16 | best swept config | best speedup |",
             "| ---: | ---: | --- | ---: | ---: | ---: | --- | ---: |"]
    for r in res.get("decode", []):
        for kind in KINDS:
            if kind not in r:
                continue
            best = r.get(f"{kind}_best")
            tail = f"{best['config']} | {best['speedup_vs_bf16']:.2f}x |" if best else " | |"
            lines.append(f"| {r['B']} | {r['L']} | {kind} | {r[kind]['us']:.1f} | "
                         f"{r[kind]['pct_copy_bw']:.0f}% | {r[kind]['speedup_vs_bf16']:.2f}x | " + tail)
    if res.get("model"):
        lines += ["", "## Model decode step (Llama-3-8B shape, random weights, CUDA graph)", "",
                  "| B | context | KV | ms/step | tokens/s | speedup vs bf16 KV |",
                  "| ---: | ---: | --- | ---: | ---: | ---: |"]
        for r in res["model"]:
            for kind in KINDS:
                if "ms" in r.get(kind, {}):
                    lines.append(f"| {r['B']} | {r['context']} | {kind} | {r[kind]['ms']:.3f} | "
                                 f"{r[kind]['tokens_per_s']:.1f} | {r[kind]['speedup_vs_bf16_kv']:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    ap.add_argument("--skip-model", action="store_true", help="kernels only")
    args = ap.parse_args(argv)
    smoke = args.smoke
    device = "cpu" if smoke else "cuda"
    dtype = torch.float16 if smoke else torch.bfloat16   # the interpreter cannot run bf16 dots
    t0 = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def log(msg):
        print(f"[{time.time() - t0:6.1f}s] {msg}", flush=True)

    res = {"meta": {"device": "cpu (smoke)" if smoke else torch.cuda.get_device_name(),
                    "torch": torch.__version__, "machine": platform.node(), "smoke": smoke}}

    def save():
        (out / "kv_cache_bench.json").write_text(json.dumps(res, indent=1))
        (out / "kv_cache_bench.md").write_text(markdown(res))

    res["correctness"] = correctness(device, dtype, log, smoke)
    save()
    if not res["correctness"]["ok"]:
        log("correctness FAILED: no timing")
        return 1
    copy_bw = 1e9   # (smoke: a nominal 1 GB/s)
    if not smoke:
        from slipstream.analysis.hardware import measure_copy_bandwidth
        copy_bw = measure_copy_bandwidth("cuda")
        res["meta"]["copy_GBps"] = copy_bw / 1e9
        log(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s")
    cases = [(1, 96), (2, 48)] if smoke else [(1, 32768), (32, 4096)]
    res["decode"] = []
    for b, length in cases:
        res["decode"].append(decode_case(b, length, copy_bw, device, dtype, smoke, log))
        save()
        if device == "cuda":
            torch.cuda.empty_cache()
    if not args.skip_model:
        res["model"] = model_step([(1, 64), (2, 40)] if smoke else cases, device, dtype, smoke, log)
        save()
    log("done")
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Decode-step kernels on the GPU in one run: correctness first, then old against new.

    python benchmarks/runtime/bench_decode_kernels.py [--out DIR] [--commit SHA]
    python benchmarks/runtime/bench_decode_kernels.py --smoke   # CPU, TRITON_INTERPRET=1, tiny shapes

Llama-3-8B attention shape: 32 query / 8 KV heads, head_dim 128, pages of 16.
1. Correctness on the device (bf16 queries): the short-context decode kernel in
   every launch config and the engine's dispatch, bf16 / int8 / fp8 caches,
   contexts 1..4k, against reference.decode_attention; rotary + KV store against
   the unfused kernels (exact) and its torch twin; a CUDA-graph replay of the new
   attention block equals its eager run.
2. The copy bandwidth, measured in this run.
3. Decode attention alone, batch 1 / 8 / 64 x context 128 / 1k / 4k x cache bf16 /
   int8 / fp8: the split-KV kernel with the split count a captured decode graph
   uses (old; unsplit up to 512) against the short-context kernel in each config,
   and the split-KV kernel split finer (splits of >= 64 keys).
4. A layer's attention block in a decode step: rotary, KV store, attention (old)
   against rotary + KV store in one kernel and the engine's attention choice (new).
Times: median us per call; each side captured in one CUDA graph over enough
copies of queries and caches (distinct pages of one pool, > 100 MB) that a replay
streams K/V from HBM, as in a decode step where the weights evict the cache from
L2. Writes DIR/decode_kernels.json and DIR/decode_kernels.md.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT), str(HERE)]

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
BATCHES, CONTEXTS, CACHES = (1, 8, 64), (128, 1024, 4096), ("bf16", "int8", "fp8")
STREAM_BYTES, MAX_COPIES = 128 << 20, 512
# The short-context kernel's configs: (BLOCK_N, warps, K/V of earlier steps read
# before the wait on the kernel before).
SHORT_CONFIGS = {"N256w8": (256, 8, True), "N256w8_late": (256, 8, False),
                 "N128w4": (128, 4, True), "N64w4": (64, 4, True)}
BF16_TOL = 3e-2
# Batch-1 GEMV against cuBLAS at the layer's weight shapes (N, K), and its configs.
GEMV_SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096),
               "down": (4096, 14336)}
GEMV_CONFIGS = {"N32K256s4": (32, 256, 4, 4), "N32K512s3": (32, 512, 4, 3),
                "N64K256w8s4": (64, 256, 8, 4), "N16K512s4": (16, 512, 4, 4)}


def _cache(torch, kind, shape, device, gen):
    """(k codes or values, v ..., k_scale, v_scale) of a random cache of `shape`."""
    x = [torch.randn(shape, device=device, generator=gen) for _ in range(2)]
    if kind == "bf16":
        return [t.to(DTYPE) for t in x] + [None, None]
    from slipstream.quant.kv_quant import KV_FORMATS
    fmt = KV_FORMATS[kind]
    out = [fmt.quantize(t.flatten(0, 1)) for t in x]
    return ([c.view(shape) for c, _ in out] + [s.view(shape[:3]) for _, s in out])


def _context_class(ctx):
    return max(512, 1 << max(ctx - 1, 1).bit_length())


def _setup(torch, b, ctx, kind, device, copies):
    """Copies of (q, tables, out, scratch, qkv, positions, slots) over one pool."""
    from slipstream.kernels.decode_attention import choose_num_splits, split_kv_scratch
    gen = torch.Generator(device=device).manual_seed(b * 131 + ctx)
    pages = -(-ctx // PAGE)
    pool = copies * b * pages + 1
    kc, vc, ks, vs = _cache(torch, kind, (pool, PAGE, KV_HEADS, HEAD_DIM), device, gen)
    perm = torch.randperm(pool, device=device, generator=gen).to(torch.int32)
    splits = choose_num_splits(b, KV_HEADS, _context_class(ctx), group=HEADS // KV_HEADS,
                               sm_count=SMS)
    fine = max(1, min(2 * SMS // (b * KV_HEADS), -(-ctx // 64), 64))
    seq_lens = torch.full((b,), ctx, dtype=torch.int32, device=device)
    data = []
    for i in range(copies):
        tables = perm[i * b * pages:(i + 1) * b * pages].view(b, pages).contiguous()
        qkv = torch.randn(b, HEADS + 2 * KV_HEADS, HEAD_DIM, device=device, generator=gen).to(DTYPE)
        pos = torch.full((b,), ctx - 1, dtype=torch.int64, device=device)
        slots = tables[:, (ctx - 1) // PAGE].long() * PAGE + (ctx - 1) % PAGE
        data.append(dict(q=qkv[:, :HEADS].contiguous(), tables=tables, qkv=qkv, pos=pos,
                         slots=slots, out=torch.empty(b, HEADS, HEAD_DIM, dtype=DTYPE, device=device),
                         scratch=split_kv_scratch(b, HEADS, max(splits, fine), HEAD_DIM, device)))
    return dict(kc=kc, vc=vc, ks=ks, vs=vs, seq_lens=seq_lens, splits=splits, fine=fine,
                data=data)


def _attn_calls(torch, s, ctx, which):
    from slipstream.kernels.decode_attention import decode_attention
    from slipstream.kernels.short_decode_attention import short_decode_attention
    calls = []
    for d in s["data"]:
        common = (d["q"], s["kc"], s["vc"], s["seq_lens"], d["tables"], HEAD_DIM ** -0.5)
        kw = dict(out=d["out"], k_scale=s["ks"], v_scale=s["vs"])
        if which in ("old", "fine"):
            n = s["splits"] if which == "old" else s["fine"]
            sc = tuple(t[:, :, :n] for t in d["scratch"]) if n > 1 else None
            calls.append(lambda common=common, kw=kw, n=n, sc=sc: decode_attention(
                *common, max_seq_len=ctx, num_splits=n, scratch=sc, config={"SHORT": False}, **kw))
        elif which == "engine":
            sc = tuple(t[:, :, :s["splits"]] for t in d["scratch"])
            calls.append(lambda common=common, kw=kw, sc=sc: decode_attention(
                *common, max_seq_len=ctx, num_splits=s["splits"], scratch=sc, **kw))
        else:
            bn, w, early = SHORT_CONFIGS[which]
            cfg = {"BLOCK_N": bn, "num_warps": w, "num_stages": 3, "EARLY_KV": early}
            calls.append(lambda common=common, kw=kw, cfg=cfg: short_decode_attention(
                *common, config=cfg, **kw))
    return calls


def _block_calls(torch, s, ctx, new, rope):
    """A layer's attention block on each copy: old = rotary, KV store, split-KV
    attention; new = rotary + KV store, the engine's attention choice."""
    from slipstream.kernels.decode_attention import decode_attention
    from slipstream.kernels.kv_store import store_kv
    from slipstream.kernels.rotary import rotary_inplace
    from slipstream.kernels.rotary_kv_store import rotary_store_kv
    h, hk = HEADS, HEADS + KV_HEADS
    calls = []
    for d in s["data"]:
        qkv, sc = d["qkv"], tuple(t[:, :, :s["splits"]] for t in d["scratch"])

        def call(qkv=qkv, d=d, sc=sc):
            caches = (s["kc"], s["vc"])
            if new:
                rotary_store_kv(qkv[:, :h], qkv[:, h:hk], qkv[:, hk:], d["pos"], rope.cos,
                                rope.sin, *caches, d["slots"], s["ks"], s["vs"])
            else:
                rotary_inplace(qkv[:, :hk], d["pos"], rope.cos, rope.sin)
                store_kv(qkv[:, h:hk], qkv[:, hk:], *caches, d["slots"], s["ks"], s["vs"])
            return decode_attention(qkv[:, :h], *caches, s["seq_lens"], d["tables"],
                                    HEAD_DIM ** -0.5, max_seq_len=ctx, num_splits=s["splits"],
                                    scratch=sc, out=d["out"], k_scale=s["ks"], v_scale=s["vs"],
                                    config=None if new else {"SHORT": False})
        calls.append(call)
    return calls


def _rope(torch, device):
    from slipstream.layers.rotary import RotaryEmbedding
    old = torch.get_default_dtype()
    torch.set_default_dtype(DTYPE)
    try:
        with torch.device(device):
            return RotaryEmbedding(HEAD_DIM, 8192, 500000.0)
    finally:
        torch.set_default_dtype(old)


def _err(torch, got, want, tol):
    e = (got.float() - want.float()).abs().max().item()
    return {"max_abs_err": e, "ok": bool(e <= tol * max(1.0, want.float().abs().max().item())
                                        and not got.isnan().any().item())}


def correctness(torch, device, contexts) -> dict:
    from slipstream.kernels import reference
    from slipstream.kernels.decode_attention import decode_attention
    from slipstream.kernels.kv_store import store_kv
    from slipstream.kernels.rotary import rotary_inplace
    from slipstream.kernels.rotary_kv_store import rotary_store_kv
    from slipstream.kernels.short_decode_attention import short_decode_attention
    out, gen = {}, torch.Generator(device=device).manual_seed(0)
    b = len(contexts)
    pages = [-(-c // PAGE) for c in contexts]
    width = max(pages) + 3
    tables = torch.zeros(b, width, dtype=torch.int32)
    perm = torch.randperm(sum(pages) + 2).to(torch.int32)
    used = 0
    for i, p in enumerate(pages):
        tables[i, :p] = perm[used:used + p]
        used += p
    tables = tables.to(device)
    seq_lens = torch.tensor(contexts, dtype=torch.int32, device=device)
    q = torch.randn(b, HEADS, HEAD_DIM, device=device, generator=gen).to(DTYPE)
    configs = {} if SMOKE else SHORT_CONFIGS
    for kind in CACHES:
        kc, vc, ks, vs = _cache(torch, kind, (sum(pages) + 2, PAGE, KV_HEADS, HEAD_DIM), device, gen)
        ref = reference.decode_attention(q.float(), kc if ks is not None else kc.float(),
                                         vc if ks is not None else vc.float(), seq_lens, tables,
                                         HEAD_DIM ** -0.5, k_scale=ks, v_scale=vs)
        for name, (bn, w, early) in {"default": (None, None, None), **configs}.items():
            cfg = None if bn is None else {"BLOCK_N": bn, "num_warps": w, "EARLY_KV": early}
            got = short_decode_attention(q, kc, vc, seq_lens, tables, HEAD_DIM ** -0.5,
                                         config=cfg, k_scale=ks, v_scale=vs)
            out[f"short_{name}_{kind}"] = _err(torch, got, ref, BF16_TOL)
        got = decode_attention(q, kc, vc, seq_lens, tables, HEAD_DIM ** -0.5,
                               max_seq_len=max(contexts), k_scale=ks, v_scale=vs)
        out[f"engine_dispatch_{kind}"] = _err(torch, got, ref, BF16_TOL)
        # rotary + KV store: exact against the two unfused kernels, close to the twin
        rope = _rope(torch, device)
        qkv = torch.randn(b, HEADS + 2 * KV_HEADS, HEAD_DIM, device=device, generator=gen).to(DTYPE)
        pos = torch.randint(0, 8192, (b,), device=device, generator=gen)
        slots = torch.randperm(kc.shape[0] * PAGE, device=device, generator=gen)[:b]
        runs = []
        for how in ("fused", "unfused", "twin"):
            x = qkv.clone()
            c = [t.clone() if t is not None else None for t in (kc, vc, ks, vs)]
            h, hk = HEADS, HEADS + KV_HEADS
            if how == "fused":
                rotary_store_kv(x[:, :h], x[:, h:hk], x[:, hk:], pos, rope.cos, rope.sin, *c[:2],
                                slots, *c[2:])
            elif how == "unfused":
                rotary_inplace(x[:, :hk], pos, rope.cos, rope.sin)
                store_kv(x[:, h:hk], x[:, hk:], *c[:2], slots, *c[2:])
            else:
                reference.rotary_store_kv(x[:, :h], x[:, h:hk], x[:, hk:], pos, rope.cos, rope.sin,
                                          *c[:2], slots, *c[2:])
            runs.append([x] + [t for t in c if t is not None])
        out[f"rotary_store_exact_{kind}"] = {"ok": all(  # bitwise, NaN and codes included
            bool(torch.equal(a.view(torch.uint8), b_.view(torch.uint8)))
            for a, b_ in zip(runs[0], runs[1]))}
        out[f"rotary_store_twin_{kind}"] = _err(torch, runs[0][0], runs[2][0], 1e-2)
        # The block as the engine chains it: the new tokens' slots poisoned (NaN
        # values or scales) until the fused kernel writes them; the attention
        # kernel, launched early, must see the written ones.
        c = [t.clone() if t is not None else None for t in (kc, vc, ks, vs)]
        new_slots = (tables[torch.arange(b, device=device), (seq_lens.long() - 1) // PAGE].long()
                     * PAGE + (seq_lens.long() - 1) % PAGE)
        for t in (c[2:] if ks is not None else c[:2]):
            t.view(-1, *t.shape[2:])[new_slots] = float("nan")
        x = qkv.clone()
        h, hk = HEADS, HEADS + KV_HEADS
        torch.cuda.synchronize() if device == "cuda" else None
        rotary_store_kv(x[:, :h], x[:, h:hk], x[:, hk:], pos, rope.cos, rope.sin, *c[:2],
                        new_slots, *c[2:])
        got = decode_attention(x[:, :h], *c[:2], seq_lens, tables, HEAD_DIM ** -0.5,
                               max_seq_len=max(contexts), k_scale=c[2], v_scale=c[3])
        ref = reference.decode_attention(x[:, :h].float(), c[0] if ks is not None else c[0].float(),
                                         c[1] if ks is not None else c[1].float(), seq_lens,
                                         tables, HEAD_DIM ** -0.5, k_scale=c[2], v_scale=c[3])
        out[f"chained_block_{kind}"] = _err(torch, got, ref, BF16_TOL)
    return out


def graph_replay_equal(torch, device) -> bool:
    rope = _rope(torch, device)
    s = _setup(torch, 2, 300, "bf16", device, 1)
    call = _block_calls(torch, s, 300, True, rope)[0]
    start = s["data"][0]["qkv"].clone()
    eager = call().clone()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s["data"][0]["qkv"].copy_(start)
    with torch.cuda.graph(g):
        out = call()
    s["data"][0]["qkv"].copy_(start)
    g.replay()
    torch.cuda.synchronize()
    return bool(torch.equal(out, eager))


def _timer(calls):
    if SMOKE:
        calls[0]()
        t = time.perf_counter()
        calls[0]()
        return (time.perf_counter() - t) * 1e3
    from benchmarks.cuda_timing import graph_timer
    return graph_timer(calls, min_calls=64, replays=10)()


def timing(torch, device, batches, contexts, caches, copy_bw) -> tuple[list, list]:
    rope = _rope(torch, device)
    attn, blocks = [], []
    for kind in caches:
        for b in batches:
            for ctx in contexts:
                kv_bytes = 2 * b * ctx * KV_HEADS * HEAD_DIM * (2 if kind == "bf16" else 1)
                copies = 1 if SMOKE else max(1, min(MAX_COPIES, math.ceil(STREAM_BYTES / kv_bytes)))
                s = _setup(torch, b, ctx, kind, device, copies)
                row = {"batch": b, "context": ctx, "cache": kind, "splits_old": s["splits"],
                       "splits_fine": s["fine"], "kv_bytes": kv_bytes, "us": {}}
                for which in ("old", "fine", "engine", *SHORT_CONFIGS):
                    row["us"][which] = _timer(_attn_calls(torch, s, ctx, which)) * 1e3
                row["engine_kernel"] = ("short" if s["splits"] == 1 and ctx <= 512 else "split_kv")
                row["speedup_engine"] = row["us"]["old"] / row["us"]["engine"]
                row["engine_pct_copy_bw"] = 100 * kv_bytes / (row["us"]["engine"] * 1e-6) / copy_bw
                attn.append(row)
                old, new = (_timer(_block_calls(torch, s, ctx, n, rope)) * 1e3 for n in (False, True))
                blocks.append({"batch": b, "context": ctx, "cache": kind, "old_us": old,
                               "new_us": new, "speedup": old / new})
                print(f"  {kind} b={b} ctx={ctx}: " + ", ".join(
                    f"{k} {v:.1f}" for k, v in row["us"].items())
                    + f" | block old {old:.1f} new {new:.1f} us", flush=True)
                del s
                if device == "cuda":
                    torch.cuda.empty_cache()
    return attn, blocks


def _gemv_cfg(name, prefetch=0):
    bn, bk, w, st = GEMV_CONFIGS[name]
    return {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w, "num_stages": st, "PREFETCH_K": prefetch}


def gemv(torch, device, copy_bw) -> dict:
    """Batch-1 GEMV (kernels/dense_gemv.py) against cuBLAS at the 8B layer's weights,
    alone, then after the kernel before it in a decode step (which lets it launch
    early: its L2 prefetch of the weight overlaps that kernel)."""
    import torch.nn.functional as F
    from slipstream.kernels.dense_gemv import dense_gemv
    from slipstream.kernels.short_decode_attention import short_decode_attention
    gen = torch.Generator(device=device).manual_seed(5)
    shapes = ({"qkv": (64, 4096), "o_proj": (64, 4096), "gate_up": (64, 4096), "down": (64, 128)}
              if SMOKE else GEMV_SHAPES)
    out = {"alone": [], "after_kernel": {}}
    for name, (n, k) in shapes.items():
        copies = 1 if SMOKE else max(1, min(8, math.ceil(256e6 / (n * k * 2))))
        ws = [(torch.randn(n, k, device=device, generator=gen) * 0.02).to(DTYPE) for _ in range(copies)]
        xs = [torch.randn(1, k, device=device, generator=gen).to(DTYPE) for _ in range(copies)]
        ref = F.linear(xs[0].float(), ws[0].float())
        row = {"name": name, "n": n, "k": k, "bytes": n * k * 2, "us": {}, "check": {}}
        for c in GEMV_CONFIGS:
            row["check"][c] = _err(torch, dense_gemv(xs[0], ws[0], config=_gemv_cfg(c)), ref, 1e-2)
        row["us"]["cublas"] = _timer([lambda x=x, w=w: F.linear(x, w) for x, w in zip(xs, ws)]) * 1e3
        for c in GEMV_CONFIGS:
            row["us"][c] = _timer([lambda x=x, w=w, c=c: dense_gemv(x, w, config=_gemv_cfg(c))
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
    ctx = 40 if SMOKE else 256
    copies = 1 if SMOKE else 4
    s = _setup(torch, 1, ctx, "bf16", device, copies)
    hidden = HEADS * HEAD_DIM
    norm_w = torch.ones(hidden, device=device, dtype=DTYPE)
    res = {}
    for name, (n, k) in shapes.items():
        ws = [(torch.randn(n, k, device=device, generator=gen) * 0.02).to(DTYPE)
              for _ in range(copies)]
        ins = [torch.randn(1, 2 * k if name == "down" else hidden, device=device,
                           generator=gen).to(DTYPE) for _ in range(copies)]
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
            row[how] = _timer([chain(i, d, how.split("_")[0], pf)
                               for i, d in enumerate(s["data"])]) * 1e3
        res[name] = row
        print(f"  {row['before']} + {name}: {row}", flush=True)
        del ws, ins
    out["after_kernel"] = res
    return out


def markdown(res) -> str:
    m = res["meta"]
    lines = [f"# Decode-step kernels ({m['device']})", "",
             f"{m['date_utc']}, commit {m['commit']}, torch {m['torch']}, triton {m['triton']}. "
             f"Copy bandwidth measured in this run: {res['copy_GBps']:.0f} GB/s. Llama-3-8B "
             "attention (32/8 heads, head_dim 128), pages of 16, bf16 queries. Median us per "
             "call, CUDA-graph replays over copies that stream K/V from HBM.", "",
             "## Correctness", "", "| check | max abs err | ok |", "| --- | ---: | --- |"]
    for k, v in res["correctness"].items():
        err = f"{v['max_abs_err']:.2e}" if "max_abs_err" in v else ""
        lines.append(f"| {k} | {err} | {v['ok']} |")
    lines += ["", f"CUDA-graph replay of the new attention block equals its eager run: "
              f"{res.get('graph_replay_equal')}", "",
              "## Decode attention alone", "",
              "old: split-KV kernel at a decode graph's split count (unsplit up to 512); fine: "
              "the same kernel split into pieces of >= 64 keys; N*w*: the short-context kernel "
              "(first tile of N keys, w warps; _late: earlier steps' K/V read after the wait "
              "on the kernel before, not before); engine: what the engine now runs.", "",
              "| cache | batch | context | splits old/fine | old | fine | "
              + " | ".join(SHORT_CONFIGS) + " | engine | engine kernel | speed-up | % copy BW |",
              "| --- | ---: | ---: | ---: | ---: | ---: | " + "---: | " * len(SHORT_CONFIGS)
              + "---: | --- | ---: | ---: |"]
    for r in res["attention"]:
        u = r["us"]
        lines.append(f"| {r['cache']} | {r['batch']} | {r['context']} | {r['splits_old']}/"
                     f"{r['splits_fine']} | {u['old']:.1f} | {u['fine']:.1f} | "
                     + " | ".join(f"{u[k]:.1f}" for k in SHORT_CONFIGS)
                     + f" | {u['engine']:.1f} | {r['engine_kernel']} | {r['speedup_engine']:.2f}x"
                     f" | {r['engine_pct_copy_bw']:.0f}% |")
    lines += ["", "## A layer's attention block (rotary, KV store, attention)", "",
              "| cache | batch | context | old us | new us | speed-up |",
              "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in res["blocks"]:
        lines.append(f"| {r['cache']} | {r['batch']} | {r['context']} | {r['old_us']:.1f} | "
                     f"{r['new_us']:.1f} | {r['speedup']:.2f}x |")
    g = res.get("gemv")
    if g:
        lines += ["", "## Batch-1 GEMV against cuBLAS (kernels/dense_gemv.py; not in the engine)", "",
                  "us (TB/s). Configs: N rows a program, K columns a step, w warps, s stages.", "",
                  "| weight | N x K | cuBLAS | " + " | ".join(GEMV_CONFIGS) + " |",
                  "| --- | --- | ---: | " + "---: | " * len(GEMV_CONFIGS)]
        for r in g["alone"]:
            lines.append(f"| {r['name']} | {r['n']}x{r['k']} | " + " | ".join(
                f"{r['us'][c]:.1f} ({r['TBps'][c]:.2f})" for c in ("cublas", *GEMV_CONFIGS)) + " |")
        lines += ["", "Each weight after the kernel before it in a decode step (which lets a "
                  "GEMV launch early), us per pair; GEMV in its best config above, without and "
                  "with an L2 prefetch of its first 1k / all weight columns before its wait:", "",
                  "| weight | kernel before | that kernel alone | + cuBLAS | + GEMV | "
                  "+ GEMV prefetch 1k | + GEMV prefetch all |",
                  "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
        for name, a in g["after_kernel"].items():
            lines.append(f"| {name} | {a['before']} | {a['alone']:.1f} | {a['cublas']:.1f} | "
                         f"{a['gemv']:.1f} | {a['gemv_prefetch1k']:.1f} | "
                         f"{a['gemv_prefetch_all']:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    global DTYPE, SMOKE, SMS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--smoke", action="store_true", help="CPU dry run, TRITON_INTERPRET=1, tiny shapes")
    ap.add_argument("--commit", default="unknown")
    args = ap.parse_args()
    SMOKE = args.smoke
    if SMOKE:
        os.environ["TRITON_INTERPRET"] = "1"   # before triton is first imported
    import torch
    import triton
    from slipstream.analysis.hardware import measure_copy_bandwidth
    if not SMOKE and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --smoke for a CPU dry run")
    device = "cpu" if SMOKE else "cuda"
    DTYPE = torch.float16 if SMOKE else torch.bfloat16   # the interpreter has no bf16 dots
    SMS = 132 if SMOKE else torch.cuda.get_device_properties(0).multi_processor_count
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    res = {"meta": {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke)",
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__, "triton": triton.__version__, "commit": args.commit}}
    print("correctness", flush=True)
    res["correctness"] = correctness(torch, device, [1, 17, 130, 256, 257, 700] if SMOKE else
                                     [1, 17, 128, 130, 255, 256, 257, 700, 4000])
    for k, v in res["correctness"].items():
        print(f"  {k}: {v}", flush=True)
    if device == "cuda":
        res["graph_replay_equal"] = graph_replay_equal(torch, device)
    res["copy_GBps"] = measure_copy_bandwidth(device, nbytes=1 << 20 if SMOKE else None) / 1e9
    print(f"copy bandwidth {res['copy_GBps']:.0f} GB/s [{time.time() - t0:.0f}s]", flush=True)
    grid = ((1,), (40,), ("bf16", "int8")) if SMOKE else (BATCHES, CONTEXTS, CACHES)
    res["attention"], res["blocks"] = timing(torch, device, *grid, res["copy_GBps"] * 1e9)
    print(f"gemv [{time.time() - t0:.0f}s]", flush=True)
    res["gemv"] = gemv(torch, device, res["copy_GBps"] * 1e9)
    for r in res["gemv"]["alone"]:
        res["correctness"].update({f"gemv_{r['name']}_{c}": v for c, v in r["check"].items()})
    (args.out / "decode_kernels.json").write_text(json.dumps(res, indent=1))
    (args.out / "decode_kernels.md").write_text(markdown(res))
    ok = all(v["ok"] for v in res["correctness"].values()) and res.get("graph_replay_equal", True)
    print(f"wrote {args.out}/decode_kernels.json and .md in {time.time() - t0:.0f}s; "
          f"correctness {'ok' if ok else 'FAILED'}", flush=True)
    if not ok:
        sys.exit(1)


DTYPE = SMOKE = SMS = None

if __name__ == "__main__":
    main()

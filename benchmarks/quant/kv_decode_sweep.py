"""Quick decode-attention comparison of the KV cache dtypes (bench_kv_cache.py --quick).

Batch 1, Llama-3-8B heads (GQA 32/8, head_dim 128), 16-token pages, contexts 4k,
32k and 128k (and batch 32 at 4k, engine path and candidates only): the bf16 cache against int8 / fp8 codes, every variant of the
quantized path (kernels/decode_attention.py KV_DOT: 0 codes -> bf16 operands,
1 codes -> fp16 operands, 2 the same with V read as 16-bit words, 3 as 2 with
int8 K codes in int8 tensor-core dots (int8 caches only); ASM: inline
PTX code conversions) at the engine's launch config, then at 32k a sweep of
launch configs and split counts for the engine's default variant, and (all
three caches) an L2 prefetch of each split's first 128 / 256 keys issued before
the split waits on the kernel before it (PREFETCH). Every timed
variant's output is first checked against the fp32 twin on the timed data
(kernels/reference.py); a variant off by more than ERR_LIMIT is not timed.
Before that, decode on a ragged batch and tree verification are checked
against their twins for each variant.
"""
from __future__ import annotations

import math
import os
import time

import torch

from kv_cache_checks import (HEAD_DIM, HEADS, KV_HEADS, PAGE, SCALE, make_timer, paged,
                             quantize_cache, rel_err)
from slipstream.kernels import decode_attention as da
from slipstream.kernels import reference
from slipstream.kernels.tree_attention import ancestor_mask, tree_attention

ERR_LIMIT = 2e-2          # relative (Frobenius) error against the twin
L2_BYTES = 256 << 20
QUANT = ("int8", "fp8")
# (label, KV_DOT, ASM): the paths of the quantized cache timed (EXTRA too with
# KV_QUICK_ALL=1: slower to compile, they only explain the steps between).
VARIANTS = [("codes_to_bf16", 0, True), ("f16_vwords", 2, True), ("int8k_f16_vwords", 3, True)]
EXTRA_VARIANTS = [("f16", 1, True), ("f16_vwords_tritonops", 2, False)]
# The new path each cache is swept and prefetched on: int8 K dots need int8 codes.
CANDIDATE = {"bf16": {}, "int8": {"KV_DOT": 3}, "fp8": {"KV_DOT": 2}}
# Launch configs swept at 32k for the default variant: (BLOCK_N, num_warps, num_stages).
CONFIGS = [(128, 4, 6), (64, 2, 6), (128, 4, 8), (32, 1, 6)]
SPLIT_FACTORS = (0.5, 1.0, 2.0, 4.0)
MAX_SPLITS = 128


def _variant_config(kv_dot, asm):
    return {"KV_DOT": kv_dot, "ASM": asm}


def check_small(device, dtype, smoke, log) -> dict:
    """Ragged decode batch (odd lengths: masked tails) and a 5-node tree, per variant."""
    gen = torch.Generator().manual_seed(1)
    ctx, nodes = ([0, 20, 70, 33] if smoke else [0, 100, 2001, 517]), 5
    b = len(ctx)
    blocks = [-(-(c + nodes) // PAGE) for c in ctx]
    # Rows a multiple of 16 entries: the kernels compiled here serve the timed runs too.
    tables = torch.zeros(b, -(-max(blocks) // 16) * 16, dtype=torch.int32)
    perm = torch.randperm(sum(blocks) + 2, generator=gen)
    used = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = perm[used:used + n]
        used += n
    shape = (sum(blocks) + 2, PAGE, KV_HEADS, HEAD_DIM)
    kc = (torch.randn(shape, generator=gen) * torch.rand(*shape[:3], 1, generator=gen) * 4).to(device, dtype)
    vc = (torch.randn(shape, generator=gen) * torch.rand(*shape[:3], 1, generator=gen) * 0.1).to(device, dtype)
    tables = tables.to(device)
    lens = torch.tensor([c + 1 for c in ctx], dtype=torch.int32, device=device)
    q = (torch.randn(b, HEADS, HEAD_DIM, generator=gen) * 3).to(device, dtype)
    tq = torch.randn(b * nodes, HEADS, HEAD_DIM, generator=gen).to(device, dtype)
    cu_tree = torch.arange(0, b * nodes + 1, nodes, dtype=torch.int32, device=device)
    tree_lens = torch.tensor([c + nodes for c in ctx], dtype=torch.int32, device=device)
    masks = ancestor_mask([-1, 0, 0, 1, 2]).expand(b, nodes, nodes).contiguous().to(device)
    res = {}
    for kind in QUANT:
        kq, ks = quantize_cache(kc, kind)
        vq, vs = quantize_cache(vc, kind)
        twin = reference.decode_attention(q.float(), kq, vq, lens, tables, SCALE, k_scale=ks, v_scale=vs)
        ttwin = reference.tree_attention(tq.float(), kq, vq, cu_tree, tree_lens, tables, masks, SCALE,
                                         k_scale=ks, v_scale=vs)
        for label, kv_dot, asm in _variants():
            if kv_dot == 3 and kind != "int8":
                continue
            cfg = _variant_config(kv_dot, asm)
            row = {}
            try:
                # The unsplit kernel and tree tiles for the engine's default only (compile time).
                default = asm and kv_dot == CANDIDATE[kind]["KV_DOT"]
                for splits in ((1, 3) if default else (3,)):
                    out = da.split_kv_attention(
                        q, kq, vq, torch.arange(b + 1, dtype=torch.int32, device=device), lens,
                        tables, 1, SCALE, splits, config=cfg, k_scale=ks, v_scale=vs)
                    row[f"decode_splits{splits}"] = rel_err(out, twin)
                if default or smoke:
                    tout = _tree(tq, kq, vq, cu_tree, tree_lens, tables, masks, nodes, ks, vs, cfg)
                    row["tree"] = rel_err(tout, ttwin)
            except Exception as e:   # a variant that does not compile is reported, not fatal
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            row["ok"] = "error" not in row and all(v < ERR_LIMIT for k, v in row.items() if k != "error")
            res[f"{kind}/{label}"] = row
            log(f"check {kind}/{label}: {row}")
    return res


def _tree(tq, kq, vq, cu, lens, tables, masks, nodes, ks, vs, cfg):
    from slipstream.kernels.tree_attention import pack_tree_mask
    bits = pack_tree_mask(masks)
    return da.split_kv_attention(tq, kq, vq, cu, lens, tables, nodes, SCALE, 2, tree_bits=bits,
                                 config=cfg, k_scale=ks, v_scale=vs)


def _timer(calls, smoke):
    return make_timer(calls, smoke, min_calls=32, replays=7)


def _variants():
    return VARIANTS + (EXTRA_VARIANTS if os.environ.get("KV_QUICK_ALL") == "1" else [])


def time_context(length, copy_bw, device, dtype, smoke, sweep, deadline, log, b=1) -> dict:
    """Decode of b requests at `length`: the engine and every path (or, with `sweep`,
    launch configs x split counts of the candidate paths); runs past `deadline`
    (time.time()) are skipped."""
    gen = torch.Generator().manual_seed(length)
    bf16_bytes = 2 * b * length * KV_HEADS * HEAD_DIM * 2
    n = 1 if smoke else max(1, min(4, math.ceil(L2_BYTES / bf16_bytes)))
    data = []
    for _ in range(n):
        k = torch.randn(b, length, KV_HEADS, HEAD_DIM, device=device, dtype=dtype)
        v = torch.randn_like(k) * 0.1
        kc, vc, tables = paged(k, v, gen)
        del k, v
        caches = {"bf16": (kc, vc, None, None)}
        for kind in QUANT:
            kq, ks = quantize_cache(kc, kind)
            vq, vs = quantize_cache(vc, kind)
            caches[kind] = (kq, vq, ks, vs)
        data.append((torch.randn(b, HEADS, HEAD_DIM, device=device, dtype=dtype), tables, caches))
    seq_lens = torch.full((b,), length, dtype=torch.int32, device=device)
    cu = torch.arange(b + 1, dtype=torch.int32, device=device)
    auto = da.choose_num_splits(b, KV_HEADS, length, group=HEADS // KV_HEADS)
    q0, t0, c0 = data[0]
    twins = {kind: reference.decode_attention(q0.float(), c0[kind][0], c0[kind][1], seq_lens, t0,
                                              SCALE, k_scale=c0[kind][2], v_scale=c0[kind][3])
             for kind in ("bf16", *QUANT)}

    def calls(kind, splits, config):
        out = []
        for q, tables, caches in data:
            kq, vq, ks, vs = caches[kind]
            o = torch.empty_like(q)
            s = da.split_kv_scratch(b, HEADS, splits, HEAD_DIM, device) if splits > 1 else None
            out.append(lambda q=q, t=tables, kq=kq, vq=vq, ks=ks, vs=vs, o=o, s=s: da.decode_attention(
                q, kq, vq, seq_lens, t, SCALE, max_seq_len=length, num_splits=splits,
                cu_seqlens_q=cu, out=o, scratch=s, config=config, k_scale=ks, v_scale=vs))
        return out

    def nbytes(kind):
        return bf16_bytes if kind == "bf16" else 2 * b * length * KV_HEADS * (HEAD_DIM + 4)

    row = {"B": b, "L": length, "copies": n, "splits_auto": auto, "runs": {}}

    def run(name, kind, splits, config):
        entry = {"kind": kind, "splits": splits, "config": config}
        if time.time() > deadline and name != "bf16/engine":
            entry["error"] = "skipped: time budget"
            row["runs"][name] = entry
            return entry
        try:
            cs = calls(kind, splits, config)
            err = rel_err(cs[0](), twins[kind])
            entry["rel_err_vs_twin"] = err
            if err < ERR_LIMIT:
                ms = _timer(cs, smoke)()
                entry.update(us=ms * 1e3, pct_copy_bw=100 * nbytes(kind) / (ms * 1e-3) / copy_bw)
            else:
                entry["error"] = "output off the twin: not timed"
        except Exception as e:
            entry["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        row["runs"][name] = entry
        return entry

    base = run("bf16/engine", "bf16", auto, None)
    if b > 1:   # the engine's path and the candidates only
        for kind in QUANT:
            run(f"{kind}/engine", kind, auto, None)
            run(f"{kind}/candidate", kind, auto, CANDIDATE[kind])
    elif not sweep:
        for kind in QUANT:
            run(f"{kind}/engine", kind, auto, None)
            for label, kv_dot, asm in _variants():
                if kv_dot < 3 or kind == "int8":
                    run(f"{kind}/{label}", kind, auto, _variant_config(kv_dot, asm))
        for kind in ("bf16", *QUANT):   # L2 prefetch of each split's first keys before its PDL wait
            run(f"{kind}/prefetch128", kind, auto, {**CANDIDATE[kind], "PREFETCH": 128})
    else:
        factors = SPLIT_FACTORS[1:2] if smoke else SPLIT_FACTORS
        configs = CONFIGS[:2] if smoke else CONFIGS
        for bn, w, st in configs:
            for splits in sorted({max(1, min(MAX_SPLITS, round(auto * f))) for f in factors}):
                for kind in QUANT:
                    cfg = {**CANDIDATE[kind], "BLOCK_N": bn, "num_warps": w, "num_stages": st}
                    run(f"{kind}/S{splits}_N{bn}_w{w}_s{st}", kind, splits, cfg)
    run("bf16/engine_again", "bf16", auto, None)   # drift check
    bf16_us = base.get("us")
    for entry in row["runs"].values():
        if bf16_us and "us" in entry:
            entry["speedup_vs_bf16"] = bf16_us / entry["us"]
    for kind in QUANT:
        timed = [(e["us"], n) for n, e in row["runs"].items() if e["kind"] == kind and "us" in e]
        if timed:
            row[f"{kind}_best"] = min(timed)[1]
    log(f"  B={b} L={length}: " + ", ".join(
        f"{n} {e['us']:.1f} us x{e.get('speedup_vs_bf16', 0):.2f}" for n, e in row["runs"].items()
        if "us" in e and ("engine" in n or "prefetch" in n or "candidate" in n
                          or n.split("/")[1] in [v[0] for v in _variants()])))
    for kind in QUANT:
        if f"{kind}_best" in row:
            e = row["runs"][row[f"{kind}_best"]]
            log(f"    {kind} best: {row[f'{kind}_best']} {e['us']:.1f} us x{e.get('speedup_vs_bf16', 0):.2f}"
                f" ({e['pct_copy_bw']:.0f}% copy bw)")
    for n, e in row["runs"].items():
        if "error" in e:
            log(f"    {n}: {e['error'][:160]}")
    return row


def markdown(res) -> str:
    meta = res["meta"]
    lines = ["# Quantized KV cache: decode attention, quick comparison", "",
             f"{meta['device']}; copy bandwidth {meta.get('copy_GBps', 0):.0f} GB/s; "
             f"{meta.get('seconds', 0):.0f} s"
             f"{' (smoke run: CPU interpreter, tiny shapes, times meaningless)' if meta['smoke'] else ''}. "
             "Batch 1 (and 32 at 4k), Llama-3-8B heads (GQA 32/8, head_dim 128), 16-token pages. "
             "KV_DOT 0: codes -> bf16 operands; 1: codes -> fp16 operands; 2: fp16 operands, V read "
             "as 16-bit words; 3: as 2, int8 K in int8 dots; ASM: inline PTX conversions. "
             f"Engine default KV_DOT {meta['default_kv_dot']}.", "",
             "Checks (relative error vs the fp32 twin): "
             + ("all pass" if all(r.get("ok") for r in res["checks"].values()) else "SOME FAIL (see JSON)"),
             "", "| B | context | run | splits | us | % copy bw | speedup vs bf16 | err vs twin |",
             "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in res.get("decode", []):
        for name, e in r["runs"].items():
            if "us" in e:
                lines.append(f"| {r['B']} | {r['L']} | {name} | {e['splits']} | {e['us']:.1f} | "
                             f"{e['pct_copy_bw']:.0f}% | {e.get('speedup_vs_bf16', 0):.2f}x | "
                             f"{e['rel_err_vs_twin']:.1e} |")
            else:
                lines.append(f"| {r['B']} | {r['L']} | {name} | {e['splits']} | error | | | "
                             f"{e.get('error', '')[:80]} |")
    return "\n".join(lines) + "\n"


def quick(out_dir, device, dtype, smoke, log, save_json, budget_s=80.0) -> int:
    """Checks, then 32k / 4k / 128k with every path, then the 32k sweep, until
    `budget_s` seconds have passed (later runs are listed as skipped)."""
    t0 = time.time()
    deadline = t0 + budget_s
    res = {"meta": {"device": "cpu (smoke)" if smoke else torch.cuda.get_device_name(),
                    "torch": torch.__version__, "smoke": smoke, "budget_s": budget_s,
                    "default_kv_dot": dict(da.DEFAULT_KV_DOT), "default_prefetch": da.DEFAULT_PREFETCH}}

    def save():
        res["meta"]["seconds"] = time.time() - t0
        save_json(res, markdown(res))

    res["checks"] = check_small(device, dtype, smoke, log)
    save()
    copy_bw = 1e9
    if not smoke:
        from slipstream.analysis.hardware import measure_copy_bandwidth
        copy_bw = measure_copy_bandwidth("cuda")
        res["meta"]["copy_GBps"] = copy_bw / 1e9
        log(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s")
    res["decode"] = []
    main = 256 if smoke else 32768
    plan = ([(1, main, False), (1, 96, False), (2, 64, False)] if smoke else
            [(1, main, False), (1, 4096, False), (1, 131072, False), (32, 4096, False)])
    for b, length, sweep in plan + [(1, main, True)]:
        try:
            res["decode"].append(time_context(length, copy_bw, device, dtype, smoke, sweep,
                                              deadline, log, b))
        except Exception as e:   # e.g. out of memory: keep what was measured
            log(f"B={b} L={length} sweep={sweep}: {type(e).__name__}: {str(e)[:300]}")
        save()
        if device == "cuda":
            torch.cuda.empty_cache()
    log("done")
    return 0 if all(r.get("ok") for r in res["checks"].values()) else 1

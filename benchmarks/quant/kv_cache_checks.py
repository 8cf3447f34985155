"""Correctness of the quantized-KV kernels for bench_kv_cache.py: the KV-store
kernel against `reference.store_kv`, and the decode, tree and paged-prefill
kernels reading int8 / fp8 codes against their twins in kernels/reference.py,
on Llama-3-8B heads (GQA 32/8, head_dim 128) in the benchmark's dtype."""
from __future__ import annotations

import time

import torch

from slipstream.kernels import reference
from slipstream.kernels.decode_attention import decode_attention
from slipstream.kernels.kv_store import store_kv
from slipstream.kernels.prefill_attention import prefill_attention
from slipstream.kernels.tree_attention import ancestor_mask, tree_attention
from slipstream.quant.kv_quant import KV_FORMATS

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
SCALE = HEAD_DIM ** -0.5
ERR_LIMIT = {"twin": 2e-2, "store_scale": 1e-5}


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


def make_timer(calls, smoke, **graph_args):
    """A function giving ms per call: CUDA-graph replays on the GPU
    (benchmarks/cuda_timing.py); on the CPU (--smoke) one wall-clock pass, so that
    every code path runs (the figures mean nothing there)."""
    if not smoke:
        from benchmarks.cuda_timing import graph_timer
        return graph_timer(calls, **graph_args)

    def wall():
        t = time.perf_counter()
        for c in calls:
            c()
        return (time.perf_counter() - t) * 1e3 / len(calls)
    return wall

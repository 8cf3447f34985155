"""Decode and tree cases: paged split-KV kernel against SDPA on contiguous KV,
as a share of the measured copy bandwidth. Timed in CUDA graphs over enough
data copies that repeated runs stream from HBM, not L2."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from slipstream.kernels.decode_attention import (
    choose_num_splits, decode_attention, split_kv_scratch)
from slipstream.kernels.tree_attention import ancestor_mask, tree_attention
import timing
from timing import bench_graph_ms, graph_timer, interleaved, paged_copy, rel_err

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
SCALE = HEAD_DIM ** -0.5
TREE_SHAPE = (16, 4096, 16)  # requests, context, tree nodes
L2_BYTES = 256 << 20  # copies until the data is several times the 50 MB L2

# Explicit configs tried in --sweep: (BLOCK_N, warps, stages, CHAIN: launched
# as a programmatic dependent of the kernel before); split counts around the
# automatic choice.
SWEEP = [(64, 2, 4, True), (64, 2, 6, True), (64, 2, 6, False)]
SPLIT_FACTORS = (0.8, 1.0, 1.2)
TREE_SWEEP = [(64, 4, 6, True), (64, 4, 6, False), (64, 4, 8, True), (64, 4, 5, True),
              (128, 4, 4, True)]


def _sweep_config(bn, w, s, chain):
    name = f"N{bn}_w{w}_s{s}" + ("" if chain else "_nochain")
    return name, {"BLOCK_N": bn, "num_warps": w, "num_stages": s, "CHAIN": chain}


def _copies(b: int, length: int, gen: torch.Generator):
    kv_bytes = 2 * b * length * KV_HEADS * HEAD_DIM * 2
    n = max(1, min(16, math.ceil(L2_BYTES / kv_bytes)))
    data = []
    for _ in range(n):
        k = torch.randn(b, length, KV_HEADS, HEAD_DIM, device=timing.DEVICE, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        k_cache, v_cache, tables = paged_copy(k, v, PAGE, gen)
        q = torch.randn(b, HEADS, HEAD_DIM, device=timing.DEVICE, dtype=torch.bfloat16)
        data.append((q, k, v, k_cache, v_cache, tables))
    return data, kv_bytes


def _setup(b: int, length: int):
    gen = torch.Generator().manual_seed(b * 7 + length)
    data, kv_bytes = _copies(b, length, gen)
    seq_lens = torch.full((b,), length, dtype=torch.int32, device=timing.DEVICE)
    cu = torch.arange(b + 1, dtype=torch.int32, device=timing.DEVICE)
    auto = choose_num_splits(b, KV_HEADS, length, group=HEADS // KV_HEADS)

    def ours_calls(splits, config=None):
        calls = []
        for q, _, _, kc, vc, tables in data:
            out = torch.empty_like(q)
            scratch = split_kv_scratch(b, HEADS, splits, HEAD_DIM, timing.DEVICE) if splits > 1 else None
            calls.append(lambda q=q, kc=kc, vc=vc, t=tables, out=out, s=scratch: decode_attention(
                q, kc, vc, seq_lens, t, SCALE, max_seq_len=length, num_splits=splits,
                cu_seqlens_q=cu, out=out, scratch=s, config=config))
        return calls
    return data, kv_bytes, auto, ours_calls


def decode(b: int, length: int, copy_bw: float, log) -> dict:
    data, kv_bytes, auto, ours_calls = _setup(b, length)
    row = {"case": "decode", "B": b, "L": length, "page_size": PAGE, "kv_bytes": kv_bytes,
           "copies": len(data), "splits_auto": auto}

    def pct(ms):
        return 100 * kv_bytes / (ms * 1e-3) / copy_bw

    # Correctness on the first copy, against SDPA in fp32 on the contiguous KV.
    q, k, v = data[0][:3]
    ref = F.scaled_dot_product_attention(q.float()[:, :, None], k.float().transpose(1, 2),
                                         v.float().transpose(1, 2), scale=SCALE, enable_gqa=True)
    out = ours_calls(auto)[0]()
    row["err_vs_fp32"] = rel_err(out, ref[:, :, 0])
    # Unchained: the split kernel launched only when the kernel before it ends.
    timers = {"ours": graph_timer(ours_calls(auto)),
              "ours_unchained": graph_timer(ours_calls(auto, {"CHAIN": False}))}
    try:
        timers["sdpa"] = graph_timer([lambda q=q, k=k, v=v: F.scaled_dot_product_attention(
            q[:, :, None], k.transpose(1, 2), v.transpose(1, 2), scale=SCALE, enable_gqa=True)
            for q, k, v, *_ in data])
    except RuntimeError as e:
        row["sdpa_error"] = str(e)[:200]
    for name, t in interleaved(timers).items():
        row.update({f"{name}_us": t["ms"] * 1e3, f"{name}_pct_copy_bw": pct(t["ms"]),
                    f"{name}_spread": t["spread"]})
    log(f"  {row}")
    return row


def decode_sweep(b: int, length: int, copy_bw: float, log) -> dict:
    """Explicit tile configs and split counts around the automatic choice."""
    data, kv_bytes, auto, ours_calls = _setup(b, length)
    row = {"case": "decode", "B": b, "L": length, "splits_auto": auto, "sweep": {}}
    for splits in sorted({max(round(auto * f), 1) for f in SPLIT_FACTORS}):
        for cfg in SWEEP:
            name, config = _sweep_config(*cfg)
            name = f"S{splits}_{name}"
            try:
                ms = bench_graph_ms(ours_calls(splits, config))
                row["sweep"][name] = {"us": ms * 1e3, "pct_copy_bw": 100 * kv_bytes / (ms * 1e-3) / copy_bw}
            except Exception as e:
                row["sweep"][name] = {"error": f"{type(e).__name__}: {str(e)[:160]}"}
    log(f"    best: {max((r.get('pct_copy_bw', 0), n) for n, r in row['sweep'].items())}")
    return row


def tree(copy_bw: float, log, sweep: bool = False) -> dict:
    """16 requests with 4k context each verify a 16-node draft tree."""
    b, ctx, nodes = TREE_SHAPE
    gen = torch.Generator().manual_seed(5)
    length = ctx + nodes
    k = torch.randn(b, length, KV_HEADS, HEAD_DIM, device=timing.DEVICE, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    k_cache, v_cache, tables = paged_copy(k, v, PAGE, gen)
    q = torch.randn(b * nodes, HEADS, HEAD_DIM, device=timing.DEVICE, dtype=torch.bfloat16)
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, nodes)]
    masks = ancestor_mask(parents).expand(b, nodes, nodes).contiguous().to(timing.DEVICE)
    cu = torch.arange(0, b * nodes + 1, nodes, dtype=torch.int32, device=timing.DEVICE)
    seq_lens = torch.full((b,), length, dtype=torch.int32, device=timing.DEVICE)
    out = torch.empty_like(q)

    def call(splits=None, config=None):
        return tree_attention(q, k_cache, v_cache, cu, seq_lens, tables, masks, SCALE,
                              max_query_len=nodes, max_seq_len=length, out=out,
                              num_splits=splits, config=config)
    call()
    full = torch.ones(nodes, length, dtype=torch.bool, device=timing.DEVICE)
    full[:, ctx:] = masks[0]
    ref = F.scaled_dot_product_attention(
        q.float().view(b, nodes, HEADS, HEAD_DIM).transpose(1, 2), k.float().transpose(1, 2),
        v.float().transpose(1, 2), attn_mask=full, scale=SCALE, enable_gqa=True)
    ref = ref.transpose(1, 2).reshape_as(out)
    kv_bytes = 2 * b * length * KV_HEADS * HEAD_DIM * 2
    ms = bench_graph_ms([call])
    row = {"case": "tree", "B": b, "context": ctx, "nodes": nodes, "parents": parents,
           "err_vs_fp32": rel_err(out, ref),
           "ours_us": ms * 1e3, "ours_pct_copy_bw": 100 * kv_bytes / (ms * 1e-3) / copy_bw}
    if sweep:
        auto = choose_num_splits(b, KV_HEADS, length, max_query_len=nodes, group=HEADS // KV_HEADS)
        row["sweep"] = {}
        for splits in sorted({1, 2, auto, auto + 1}):
            for c in TREE_SWEEP:
                name, cfg = _sweep_config(*c)
                name = f"S{splits}_{name}"
                try:
                    out.fill_(float("nan"))
                    call(splits, cfg)
                    err = rel_err(out, ref)
                    ms = bench_graph_ms([lambda: call(splits, cfg)])
                    row["sweep"][name] = {"us": ms * 1e3, "err": err,
                                          "pct_copy_bw": 100 * kv_bytes / (ms * 1e-3) / copy_bw}
                except Exception as e:
                    row["sweep"][name] = {"error": f"{type(e).__name__}: {str(e)[:160]}"}
        log(f"    tree best: {max((r.get('pct_copy_bw', 0), n) for n, r in row['sweep'].items())}")
    log(f"  {row}")
    return row

"""Prefill cases: dense (against SDPA flash / cuDNN), varlen, paged-KV, FP8."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from slipstream.kernels.fp8_attention import (
    fp8_prefill_attention, quantize_fp8_blocks, random_orthogonal)
from slipstream.kernels.prefill_attention import _prefill_tuned, prefill_attention
import timing
from timing import bench_ms, cu_seqlens, interleaved, paged_copy, rel_err

TOKENS, HEADS, HEAD_DIM = 16384, 16, 128
SCALE = HEAD_DIM ** -0.5
PAGED = [("paged_all_keys", 4, 0, 4096), ("paged_chunk_3k+1k", 4, 3072, 1024)]  # name, B, ctx, new
FP8_SHAPE = (4, 4096)  # B, N
BACKENDS = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}

# Explicit configs tried in --sweep. 128x64 tiles in 2 stages with at most 128
# registers a thread fit two programs on an SM (98 KB shared memory each), so
# one program's prologue and epilogue overlap the other's loop.
_BIG = {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3}
_TWO = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2, "maxnreg": 128}
# PAIRED (causal only): one program owns query blocks last - p and p.
SWEEP = [_BIG, {**_BIG, "TMA_STORE": True}, _TWO, {**_TWO, "TMA_STORE": True},
         {**_BIG, "PAIRED": True}, {**_TWO, "TMA_STORE": True, "PAIRED": True}]


def attn_flops(q_lens, k_lens, causal, heads=HEADS, head_dim=HEAD_DIM) -> float:
    """4 * nq * nk * d per head (QK^T and PV); causal self-attention counts half
    of the nq x nq square (the usual convention)."""
    total = 0.0
    for nq, nk in zip(q_lens, k_lens):
        ctx = nk - nq
        total += 4 * heads * head_dim * (nq * ctx + (nq * nq / 2 if causal else nq * nq))
    return total


def _no_cache(num_seqs, hkv, device, dtype):
    return (torch.empty(1, 16, hkv, HEAD_DIM, dtype=dtype, device=device),
            torch.zeros(num_seqs, dtype=torch.int32, device=device),
            torch.zeros(num_seqs, 1, dtype=torch.int32, device=device))


def _sdpa(q, k, v, b, n, causal, backend):
    qb, kb, vb = (x.view(b, n, x.shape[1], HEAD_DIM).transpose(1, 2) for x in (q, k, v))

    def run():
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(qb, kb, vb, is_causal=causal, scale=SCALE)
    try:
        run()
    except RuntimeError:  # some backends want BHSD-contiguous inputs
        qb, kb, vb = qb.contiguous(), kb.contiguous(), vb.contiguous()
        run()
    return run


def _dense_data(n: int):
    b = TOKENS // n
    dev = timing.DEVICE
    q, k, v = (torch.randn(TOKENS, HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16) for _ in range(3))
    cache, ctx, tables = _no_cache(b, HEADS, dev, torch.bfloat16)
    return b, q, k, v, cu_seqlens([n] * b, dev), cache, ctx, tables


def dense(n: int, causal: bool, log) -> dict:
    b, q, k, v, cu, cache, ctx, tables = _dense_data(n)
    flops = attn_flops([n] * b, [n] * b, causal)
    row = {"case": "dense", "N": n, "B": b, "causal": causal, "heads": HEADS, "flops": flops}
    ref = None
    timers = {}
    for name, backend in BACKENDS.items():
        try:
            fn = _sdpa(q, k, v, b, n, causal, backend)
            out = fn()
            ref = out if ref is None else ref
            timers[name] = lambda fn=fn: bench_ms(fn)
        except RuntimeError as e:
            row[name + "_error"] = str(e)[:200]
    out = torch.full_like(q, float("nan"))
    ours = lambda: prefill_attention(q, k, v, cache, cache, cu, ctx, tables, n, SCALE,  # noqa: E731
                                     causal=causal, out=out)
    ours()
    if ref is not None:
        row["err_vs_sdpa"] = rel_err(out, ref.transpose(1, 2).reshape(TOKENS, HEADS, HEAD_DIM))
    timers["ours"] = lambda: bench_ms(ours)
    for name, t in interleaved(timers).items():
        row[name + "_tflops"] = flops / t["ms"] / 1e9
        row[name + "_spread"] = t["spread"]
    row["tuned_configs_so_far"] = {str(k_): str(c) for k_, c in _prefill_tuned.cache.items()}
    return row


def dense_sweep(n: int, causal: bool, log) -> dict:
    """Explicit tile configs on the dense case; each output checked against SDPA flash."""
    b, q, k, v, cu, cache, ctx, tables = _dense_data(n)
    flops = attn_flops([n] * b, [n] * b, causal)
    ref = _sdpa(q, k, v, b, n, causal, SDPBackend.FLASH_ATTENTION)().transpose(1, 2).reshape_as(q)
    out = torch.empty_like(q)
    row = {"case": "dense", "N": n, "causal": causal, "sweep": {}}
    for cfg in SWEEP:
        if cfg.get("PAIRED") and not causal:
            continue
        name = (f"M{cfg['BLOCK_M']}_N{cfg['BLOCK_N']}_w{cfg['num_warps']}_s{cfg['num_stages']}"
                + (f"_r{cfg['maxnreg']}" if "maxnreg" in cfg else "")
                + ("_tmastore" if cfg.get("TMA_STORE") else "")
                + ("_paired" if cfg.get("PAIRED") else ""))
        fn = lambda cfg=cfg: prefill_attention(q, k, v, cache, cache, cu, ctx, tables, n, SCALE,  # noqa: E731
                                               causal=causal, out=out, config=cfg)
        try:
            out.fill_(float("nan"))
            fn()
            row["sweep"][name] = {"tflops": flops / bench_ms(fn) / 1e9, "err": rel_err(out, ref)}
        except Exception as e:  # a config that does not compile is a result too
            row["sweep"][name] = {"error": f"{type(e).__name__}: {str(e)[:160]}"}
        log(f"    {name}: {row['sweep'][name]}")
    return row


def varlen(log) -> dict:
    """Random prompt lengths summing to 16k tokens, causal; SDPA runs per request."""
    gen = torch.Generator().manual_seed(1)
    lengths, total = [], 0
    while total < TOKENS:
        n = min(int(torch.randint(200, 4000, (1,), generator=gen)), TOKENS - total)
        lengths.append(n)
        total += n
    dev = timing.DEVICE
    q, k, v = (torch.randn(TOKENS, HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16) for _ in range(3))
    cu = cu_seqlens(lengths, dev)
    cache, ctx, tables = _no_cache(len(lengths), HEADS, dev, torch.bfloat16)
    flops = attn_flops(lengths, lengths, True)
    out = torch.empty_like(q)
    ours = lambda: prefill_attention(q, k, v, cache, cache, cu, ctx, tables, max(lengths), SCALE,  # noqa: E731
                                     out=out)
    ours()
    starts = cu.tolist()
    seqs = [tuple(x[a:e].transpose(0, 1)[None] for x in (q, k, v))  # [1, H, n, D]
            for a, e in zip(starts[:-1], starts[1:])]
    row = {"case": "varlen", "lengths": lengths, "causal": True, "flops": flops}
    for name, backend in BACKENDS.items():
        def loop(backend=backend):
            with sdpa_kernel([backend]):
                return [F.scaled_dot_product_attention(a, b_, c, is_causal=True, scale=SCALE)
                        for a, b_, c in seqs]
        try:
            ref = loop()
            row[name + "_loop_tflops"] = flops / bench_ms(loop) / 1e9
        except RuntimeError as e:
            row[name + "_error"] = str(e)[:200]
    ref = torch.cat([o[0].transpose(0, 1) for o in ref])
    row["err_vs_sdpa"] = rel_err(out, ref)
    row["ours_tflops"] = flops / bench_ms(ours) / 1e9
    return row


def paged(log) -> list[dict]:
    """K/V through block tables (page 16): all keys from the cache, and chunked
    prefill (3k cached context + 1k new tokens per request)."""
    dev, gen = timing.DEVICE, torch.Generator().manual_seed(2)
    rows = []
    for name, b, ctx_len, new in PAGED:
        total = ctx_len + new
        kc = torch.randn(b, total, HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        k_cache, v_cache, tables = paged_copy(kc, vc, 16, gen)
        q = torch.randn(b * new, HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16)
        k_new = kc[:, ctx_len:].reshape(b * new, HEADS, HEAD_DIM)
        v_new = vc[:, ctx_len:].reshape(b * new, HEADS, HEAD_DIM)
        cu = cu_seqlens([new] * b, dev)
        ctx = torch.full((b,), ctx_len, dtype=torch.int32, device=dev)
        read_new = ctx_len > 0  # chunk: new K/V from the fresh tensors; else all from the cache
        out = torch.empty_like(q)
        fn = lambda: prefill_attention(q, k_new if read_new else None, v_new if read_new else None,  # noqa: E731
                                       k_cache, v_cache, cu, ctx, tables, new, SCALE, out=out)
        fn()
        qb = q.view(b, new, HEADS, HEAD_DIM).transpose(1, 2)
        # Bottom-right causal: query i sees keys <= ctx + i.
        mask = torch.ones(new, total, dtype=torch.bool, device=dev).tril(ctx_len)
        ref = F.scaled_dot_product_attention(qb, kc.transpose(1, 2), vc.transpose(1, 2),
                                             attn_mask=mask, scale=SCALE)
        flops = attn_flops([new] * b, [total] * b, True)
        rows.append({"case": name, "B": b, "context": ctx_len, "new": new, "page_size": 16,
                     "flops": flops, "err_vs_sdpa": rel_err(out, ref.transpose(1, 2).reshape_as(out)),
                     "ours_tflops": flops / bench_ms(fn) / 1e9})
        log(f"  {rows[-1]}")
    return rows


def fp8(log) -> dict:
    """FP8 QK^T accuracy against bf16 on data with outliers (0.1% of entries
    drawn from N(0, 10^2), as in the FlashAttention-3 paper), and its speed."""
    dev, (b, n) = timing.DEVICE, FP8_SHAPE
    gen = torch.Generator(device=dev).manual_seed(3)

    def draw():
        x = torch.randn(b * n, HEADS, HEAD_DIM, device=dev, generator=gen)
        outliers = torch.rand(x.shape, device=dev, generator=gen) < 1e-3
        return torch.where(outliers, 10 * torch.randn(x.shape, device=dev, generator=gen), x)
    q32, k32, v32 = draw(), draw(), draw()
    q, k, v = (x.to(torch.bfloat16) for x in (q32, k32, v32))
    cu = cu_seqlens([n] * b, dev)
    cache, ctx, tables = _no_cache(b, HEADS, dev, torch.bfloat16)
    qb, kb, vb = (x.double().view(b, n, HEADS, HEAD_DIM).transpose(1, 2) for x in (q32, k32, v32))
    exact = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=SCALE)
    exact = exact.transpose(1, 2).reshape(b * n, HEADS, HEAD_DIM)
    row = {"case": "fp8_accuracy", "B": b, "N": n, "data": "N(0,1), 0.1% outliers N(0,100)"}
    row["err_bf16_kernel"] = rel_err(prefill_attention(q, k, v, cache, cache, cu, ctx, tables, n, SCALE), exact)
    for name, rotate, block in [("fp8_block64_rotated", True, 64), ("fp8_block64", False, 64),
                                ("fp8_per_head_seq", False, n), ("fp8_per_head_seq_rotated", True, n)]:
        out = fp8_prefill_attention(q, k, v, cu, n, SCALE, rotate=rotate, quant_block=block)
        row["err_" + name] = rel_err(out, exact)
    flops = attn_flops([n] * b, [n] * b, True)
    rot = random_orthogonal(HEAD_DIM, dev)
    q8, qs = quantize_fp8_blocks(q.float() @ rot, cu, 64)
    k8, ks = quantize_fp8_blocks(k.float() @ rot, cu, 64)
    out = torch.empty_like(q)
    row["bf16_tflops"] = flops / bench_ms(
        lambda: prefill_attention(q, k, v, cache, cache, cu, ctx, tables, n, SCALE, out=out)) / 1e9
    row["fp8_kernel_tflops"] = flops / bench_ms(
        lambda: prefill_attention(q8, k8, v, cache, cache, cu, ctx, tables, n, SCALE,
                                  q_scale=qs, k_scale=ks, out=out)) / 1e9
    row["fp8_with_rotation_and_quant_tflops"] = flops / bench_ms(
        lambda: fp8_prefill_attention(q, k, v, cu, n, SCALE, out=out)) / 1e9
    log(f"  {row}")
    return row

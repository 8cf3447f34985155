"""Cases and checks of bench_decode_kernels.py: random paged caches (bf16, int8,
fp8) over one pool, the old and new decode attention calls and attention blocks
on them, and the correctness checks run on the device before any timing."""
from __future__ import annotations

import time
from types import SimpleNamespace

# Set by the benchmark's main: the query dtype, the CPU dry run, the SM count.
RUN = SimpleNamespace(dtype=None, smoke=False, sms=132)

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
CACHES = ("bf16", "int8", "fp8")
# The short-context kernel's configs: (BLOCK_N, warps, K/V of earlier steps read
# before the wait on the kernel before).
SHORT_CONFIGS = {"N256w8": (256, 8, False), "N256w8_early": (256, 8, True),
                 "N128w4": (128, 4, False), "N64w4": (64, 4, False)}
BF16_TOL = 3e-2


def random_cache(torch, kind, shape, device, gen):
    """(k codes or values, v ..., k_scale, v_scale) of a random cache of `shape`."""
    x = [torch.randn(shape, device=device, generator=gen) for _ in range(2)]
    if kind == "bf16":
        return [t.to(RUN.dtype) for t in x] + [None, None]
    from slipstream.quant.kv_quant import KV_FORMATS
    fmt = KV_FORMATS[kind]
    out = [fmt.quantize(t.flatten(0, 1)) for t in x]
    return ([c.view(shape) for c, _ in out] + [s.view(shape[:3]) for _, s in out])


def _context_class(ctx):
    return max(512, 1 << max(ctx - 1, 1).bit_length())


def setup_case(torch, b, ctx, kind, device, copies):
    """Copies of (q, tables, out, scratch, qkv, positions, slots) over one pool."""
    from slipstream.kernels.decode_attention import choose_num_splits, split_kv_scratch
    gen = torch.Generator(device=device).manual_seed(b * 131 + ctx)
    pages = -(-ctx // PAGE)
    pool = copies * b * pages + 1
    kc, vc, ks, vs = random_cache(torch, kind, (pool, PAGE, KV_HEADS, HEAD_DIM), device, gen)
    perm = torch.randperm(pool, device=device, generator=gen).to(torch.int32)
    splits = choose_num_splits(b, KV_HEADS, _context_class(ctx), group=HEADS // KV_HEADS,
                               sm_count=RUN.sms)
    fine = max(1, min(2 * RUN.sms // (b * KV_HEADS), -(-ctx // 64), 64))
    seq_lens = torch.full((b,), ctx, dtype=torch.int32, device=device)
    # Passed to every call, as the engine does (else decode_attention launches an
    # index kernel of its own before the attention, in the graph too).
    cu = torch.arange(b + 1, dtype=torch.int32, device=device)
    data = []
    for i in range(copies):
        tables = perm[i * b * pages:(i + 1) * b * pages].view(b, pages).contiguous()
        qkv = torch.randn(b, HEADS + 2 * KV_HEADS, HEAD_DIM, device=device, generator=gen).to(RUN.dtype)
        pos = torch.full((b,), ctx - 1, dtype=torch.int64, device=device)
        slots = tables[:, (ctx - 1) // PAGE].long() * PAGE + (ctx - 1) % PAGE
        data.append(dict(q=qkv[:, :HEADS].contiguous(), tables=tables, qkv=qkv, pos=pos,
                         slots=slots, out=torch.empty(b, HEADS, HEAD_DIM, dtype=RUN.dtype, device=device),
                         scratch=split_kv_scratch(b, HEADS, max(splits, fine), HEAD_DIM, device)))
    return dict(kc=kc, vc=vc, ks=ks, vs=vs, seq_lens=seq_lens, splits=splits, fine=fine,
                data=data, cu=cu)


def attention_calls(torch, s, ctx, which):
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
                *common, max_seq_len=ctx, num_splits=n, scratch=sc, config={"SHORT": False},
                cu_seqlens_q=s["cu"], **kw))
        elif which == "engine":
            sc = tuple(t[:, :, :s["splits"]] for t in d["scratch"])
            calls.append(lambda common=common, kw=kw, sc=sc: decode_attention(
                *common, max_seq_len=ctx, num_splits=s["splits"], scratch=sc,
                cu_seqlens_q=s["cu"], **kw))
        else:
            bn, w, early = SHORT_CONFIGS[which]
            cfg = {"BLOCK_N": bn, "num_warps": w, "num_stages": 3, "EARLY_KV": early}
            calls.append(lambda common=common, kw=kw, cfg=cfg: short_decode_attention(
                *common, config=cfg, **kw))
    return calls


def block_calls(torch, s, ctx, new, rope):
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
                                    cu_seqlens_q=s["cu"],
                                    config=None if new else {"SHORT": False})
        calls.append(call)
    return calls


def rope_tables(torch, device):
    from slipstream.layers.rotary import RotaryEmbedding
    old = torch.get_default_dtype()
    torch.set_default_dtype(RUN.dtype)
    try:
        with torch.device(device):
            return RotaryEmbedding(HEAD_DIM, 8192, 500000.0)
    finally:
        torch.set_default_dtype(old)


def max_err(torch, got, want, tol):
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
    q = torch.randn(b, HEADS, HEAD_DIM, device=device, generator=gen).to(RUN.dtype)
    configs = {} if RUN.smoke else SHORT_CONFIGS
    for kind in CACHES:
        kc, vc, ks, vs = random_cache(torch, kind, (sum(pages) + 2, PAGE, KV_HEADS, HEAD_DIM), device, gen)
        ref = reference.decode_attention(q.float(), kc if ks is not None else kc.float(),
                                         vc if ks is not None else vc.float(), seq_lens, tables,
                                         HEAD_DIM ** -0.5, k_scale=ks, v_scale=vs)
        for name, (bn, w, early) in {"default": (None, None, None), **configs}.items():
            cfg = None if bn is None else {"BLOCK_N": bn, "num_warps": w, "EARLY_KV": early}
            got = short_decode_attention(q, kc, vc, seq_lens, tables, HEAD_DIM ** -0.5,
                                         config=cfg, k_scale=ks, v_scale=vs)
            out[f"short_{name}_{kind}"] = max_err(torch, got, ref, BF16_TOL)
        got = decode_attention(q, kc, vc, seq_lens, tables, HEAD_DIM ** -0.5,
                               max_seq_len=max(contexts), k_scale=ks, v_scale=vs)
        out[f"engine_dispatch_{kind}"] = max_err(torch, got, ref, BF16_TOL)
        # rotary + KV store: exact against the two unfused kernels, close to the twin
        rope = rope_tables(torch, device)
        qkv = torch.randn(b, HEADS + 2 * KV_HEADS, HEAD_DIM, device=device, generator=gen).to(RUN.dtype)
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
        out[f"rotary_store_twin_{kind}"] = max_err(torch, runs[0][0], runs[2][0], 1e-2)
        # The block as the engine chains it: the new tokens' slots poisoned (NaN
        # values or scales) until the fused kernel writes them; the attention
        # kernel, launched early, must see the written ones.
        new_slots = (tables[torch.arange(b, device=device), (seq_lens.long() - 1) // PAGE].long()
                     * PAGE + (seq_lens.long() - 1) % PAGE)
        for kernel, short in (("split", False), ("short", True)):
            c = [t.clone() if t is not None else None for t in (kc, vc, ks, vs)]
            for t in (c[2:] if ks is not None else c[:2]):
                t.view(-1, *t.shape[2:])[new_slots] = float("nan")
            x = qkv.clone()
            h, hk = HEADS, HEADS + KV_HEADS
            torch.cuda.synchronize() if device == "cuda" else None
            rotary_store_kv(x[:, :h], x[:, h:hk], x[:, hk:], pos, rope.cos, rope.sin, *c[:2],
                            new_slots, *c[2:])
            got = decode_attention(x[:, :h], *c[:2], seq_lens, tables, HEAD_DIM ** -0.5,
                                   max_seq_len=max(contexts), k_scale=c[2], v_scale=c[3],
                                   config={"SHORT": short})
            ref = reference.decode_attention(
                x[:, :h].float(), c[0] if ks is not None else c[0].float(),
                c[1] if ks is not None else c[1].float(), seq_lens, tables, HEAD_DIM ** -0.5,
                k_scale=c[2], v_scale=c[3])
            out[f"chained_block_{kernel}_{kind}"] = max_err(torch, got, ref, BF16_TOL)
    return out


def graph_replay_equal(torch, device) -> bool:
    rope = rope_tables(torch, device)
    s = setup_case(torch, 2, 300, "bf16", device, 1)
    call = block_calls(torch, s, 300, True, rope)[0]
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


def time_calls(calls):
    if RUN.smoke:
        calls[0]()
        t = time.perf_counter()
        calls[0]()
        return (time.perf_counter() - t) * 1e3
    from benchmarks.cuda_timing import graph_timer
    return graph_timer(calls, min_calls=64, replays=10)()

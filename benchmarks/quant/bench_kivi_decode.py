"""KIVI decode attention (kernels/kivi_decode.py) against the bf16 and fp8 caches'
split-KV kernel, Llama-3-8B heads (GQA 32/8, head_dim 128), 16-token pages.

1. Correctness: the kernel against its twin (fp32 attention over `PagedKIVI.read`)
   for every case, and the error KIVI itself adds (against the exact bf16 cache).
2. Timing: CUDA graphs over enough data copies that every call streams from HBM
   (benchmarks/cuda_timing.py), medians of interleaved rounds; microseconds, bytes
   moved (codes, scales, zeros, the window's bf16 pages, block-table and window-map
   reads left out), % of the copy bandwidth measured in the same run, and speedup
   over the bf16 cache. A launch sweep (pages a tile, warps, stages, splits) for
   KIVI at each case; KIVI pages (the engine's block size, KIVI's key group) of 16, 32 and 64.

Each request's cache is as the engine leaves it during decoding: all but the
newest 2 complete pages and the partial one sealed.

    python benchmarks/quant/bench_kivi_decode.py --out DIR           # H200, ~2 min
    python benchmarks/quant/bench_kivi_decode.py --smoke --out DIR   # CPU, interpreter
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import math
import os
import subprocess
import sys
from pathlib import Path

if "--smoke" in sys.argv:   # before triton is imported anywhere
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from kv_cache_checks import (  # noqa: E402
    HEAD_DIM, HEADS, KV_HEADS, PAGE, SCALE, make_timer, paged, quantize_cache, rel_err)
from slipstream.analysis.hardware import measure_copy_bandwidth  # noqa: E402
from slipstream.cache.kivi_paged import PagedKIVI  # noqa: E402
from slipstream.kernels.decode_attention import (  # noqa: E402
    choose_num_splits, decode_attention, split_kv_scratch)
from slipstream.kernels.kivi_decode import (  # noqa: E402
    kivi_decode_attention, kivi_decode_reference)

STREAM_BYTES = 160 << 20     # data copies per contender: at least this much a graph


def kivi_store(k, v, tables, bits, device, page=PAGE):
    """A PagedKIVI holding K/V [B, L, Hkv, D] at the pages of `tables`, sealed as
    the engine seals during decoding."""
    b, length = k.shape[:2]
    store = PagedKIVI(int(tables.max()) + 1, page, KV_HEADS, HEAD_DIM, bits, k.dtype, device,
                      window_slots=b * 4)
    pos = torch.arange(length, device=device)
    for i in range(b):
        slots = tables[i].long()[pos // page] * page + pos % page
        store.store(k[i], v[i], slots)
    store.seal_many(tables.cpu(), [length] * b)
    return store


def clone_store(store):
    c = copy.copy(store)
    for name in ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero", "win_k", "win_v"):
        setattr(c, name, getattr(store, name).clone())
    return c


def kivi_bytes(store, b, length) -> int:
    sealed = store.sealed_blocks(length)
    per_page = sum(getattr(store, n)[0].numel() * getattr(store, n).element_size()
                   for n in ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero"))
    window = (length - sealed * store.block_size) * KV_HEADS * HEAD_DIM * 2 * 2
    return b * (sealed * per_page + window)


def case(b, length, page, copy_bw, device, smoke, log, sweep) -> dict:
    gen = torch.Generator().manual_seed(b * 7 + length)
    dtype = torch.float16 if smoke else torch.bfloat16   # (the interpreter mishandles bf16)
    bf16_bytes = 2 * b * length * KV_HEADS * HEAD_DIM * 2
    n = 1 if smoke else max(1, min(8, math.ceil(STREAM_BYTES / bf16_bytes * 4)))
    seq_lens = torch.full((b,), length, dtype=torch.int32, device=device)
    cu = torch.arange(b + 1, dtype=torch.int32, device=device)
    auto = choose_num_splits(b, KV_HEADS, length, group=HEADS // KV_HEADS)
    data = []
    row = {"B": b, "L": length, "kivi_page": page, "copies": n, "splits_auto": auto}
    for c in range(n):
        k = torch.randn(b, length, KV_HEADS, HEAD_DIM, device=device, dtype=dtype)
        v = torch.randn_like(k)
        kc, vc, tables = paged(k, v, gen)
        q = torch.randn(b, HEADS, HEAD_DIM, device=device, dtype=dtype)
        caches = {"bf16": (kc, vc, None, None)}
        kq, ks = quantize_cache(kc, "fp8")
        vq, vs = quantize_cache(vc, "fp8")
        caches["fp8"] = (kq, vq, ks, vs)
        stores = {}
        pages = length // page
        kivi_tables = torch.randperm(b * pages, generator=gen).view(b, pages).to(torch.int32).to(device)
        for bits in (4, 2):
            stores[bits] = kivi_store(k, v, kivi_tables, bits, device, page)
        del k, v
        data.append((q, tables, kivi_tables, caches, stores))
    q, tables, kivi_tables, caches, stores = data[0]
    exact = decode_attention(q, *caches["bf16"][:2], seq_lens, tables, SCALE, max_seq_len=length,
                             cu_seqlens_q=cu)
    for bits in (4, 2):
        got = kivi_decode_attention(q, stores[bits], seq_lens, kivi_tables, SCALE, max_seq_len=length)
        twin = kivi_decode_reference(q, stores[bits], seq_lens, kivi_tables, SCALE)
        row[f"kivi{bits}_rel_err_vs_twin"] = rel_err(got, twin)
        row[f"kivi{bits}_rel_err_vs_bf16_kv"] = rel_err(got, exact)
    fp8 = decode_attention(q, *caches["fp8"][:2], seq_lens, tables, SCALE, max_seq_len=length,
                           cu_seqlens_q=cu, k_scale=caches["fp8"][2], v_scale=caches["fp8"][3])
    row["fp8_rel_err_vs_bf16_kv"] = rel_err(fp8, exact)
    row["correct"] = all(row[f"kivi{bits}_rel_err_vs_twin"] < 1e-2 for bits in (4, 2))
    log(f"  B={b} L={length} KIVI page {page}: kivi4 vs twin {row['kivi4_rel_err_vs_twin']:.1e}, kivi2 "
        f"{row['kivi2_rel_err_vs_twin']:.1e}; vs the bf16 cache kivi4 "
        f"{row['kivi4_rel_err_vs_bf16_kv']:.1e}, kivi2 {row['kivi2_rel_err_vs_bf16_kv']:.1e}, "
        f"fp8 {row['fp8_rel_err_vs_bf16_kv']:.1e}")
    if not row["correct"]:
        return row

    def dense_calls(kind):
        out = []
        for q, t, _, caches, _ in data:
            kq, vq, ks, vs = caches[kind]
            o = torch.empty_like(q)
            s = split_kv_scratch(b, HEADS, auto, HEAD_DIM, device) if auto > 1 else None
            out.append(lambda q=q, t=t, kq=kq, vq=vq, ks=ks, vs=vs, o=o, s=s: decode_attention(
                q, kq, vq, seq_lens, t, SCALE, max_seq_len=length, cu_seqlens_q=cu, out=o,
                scratch=s, k_scale=ks, v_scale=vs))
        return out

    def kivi_calls(bits, splits=None, config=None):
        out = []
        for q, _, t, _, stores in data:
            o = torch.empty_like(q)
            out.append(lambda q=q, t=t, st=stores[bits], o=o: kivi_decode_attention(
                q, st, seq_lens, t, SCALE, max_seq_len=length, num_splits=splits, out=o,
                config=config))
        return out

    timers = {"bf16": make_timer(dense_calls("bf16"), smoke),
              "fp8": make_timer(dense_calls("fp8"), smoke),
              "kivi4": make_timer(kivi_calls(4), smoke),
              "kivi2": make_timer(kivi_calls(2), smoke)}
    times = {k: [] for k in timers}
    for _ in range(1 if smoke else 5):
        for k, t in timers.items():
            times[k].append(t())
    med = {k: sorted(ts)[len(ts) // 2] for k, ts in times.items()}
    nbytes = {"bf16": bf16_bytes, "fp8": 2 * b * length * KV_HEADS * (HEAD_DIM + 4),
              "kivi4": kivi_bytes(stores[4], b, length), "kivi2": kivi_bytes(stores[2], b, length)}
    for k in timers:
        ms = med[k]
        row[k] = {"us": ms * 1e3, "bytes": nbytes[k], "pct_copy_bw": 100 * nbytes[k] / (ms * 1e-3) / copy_bw,
                  "speedup_vs_bf16": med["bf16"] / ms}
    log("    " + ", ".join(f"{k} {row[k]['us']:.1f} us ({row[k]['pct_copy_bw']:.0f}% bw, "
                           f"x{row[k]['speedup_vs_bf16']:.2f})" for k in timers))
    if sweep:
        res = {}
        grid = [(1, 4, 2), (1, 2, 2), (2, 2, 2), (2, 4, 2), (4, 4, 2), (4, 2, 2)]
        for pages, w, st in grid[:2] if smoke else grid:
            if pages * page > 128:
                continue
            for f in (0.5, 1, 2):
                splits = max(1, min(64, round(auto * f)))
                name = f"P{pages}_w{w}_s{st}_S{splits}"
                if name in res:
                    continue
                cfg = {"PAGES": pages, "num_warps": w, "num_stages": st}
                try:
                    ms = make_timer(kivi_calls(4, splits, cfg), smoke)()
                    res[name] = {"us": ms * 1e3, "speedup_vs_bf16": med["bf16"] / ms}
                except Exception as e:   # e.g. out of shared memory
                    res[name] = {"error": f"{type(e).__name__}: {str(e)[:120]}"}
        best = max((r["speedup_vs_bf16"], n) for n, r in res.items() if "us" in r)
        row["kivi4_sweep"], row["kivi4_best"] = res, {"config": best[1], **res[best[1]]}
        log(f"    kivi4 best: {best[1]} {res[best[1]]['us']:.1f} us x{best[0]:.2f}")
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU, interpreter, tiny shapes")
    ap.add_argument("--no-sweep", action="store_true")
    args = ap.parse_args(argv)
    device = "cpu" if args.smoke else "cuda"
    lines = []

    def log(s):
        print(s, flush=True)
        lines.append(s)
    copy_bw = 1.0 if args.smoke else measure_copy_bandwidth(device)
    cases = ([(1, 256, 16), (2, 128, 32)] if args.smoke else
             [(1, 4096, 16), (1, 32768, 16), (1, 131072, 16), (32, 4096, 16), (1, 32768, 32),
              (1, 32768, 64)])
    meta = {"device": "cpu (interpreter)" if args.smoke else torch.cuda.get_device_name(),
            "date": datetime.date.today().isoformat(), "torch": torch.__version__,
            "triton": __import__("triton").__version__, "copy_gbs": copy_bw / 1e9,
            "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                     text=True, cwd=ROOT).stdout.strip()}
    log(f"{meta}")
    rows = []
    for b, length, page in cases:
        rows.append(case(b, length, page, copy_bw, device, args.smoke, log, not args.no_sweep))
        torch.cuda.empty_cache() if not args.smoke else None
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "kivi_decode.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        (out / "kivi_decode.log").write_text("\n".join(lines) + "\n")
    return 0 if all(r["correct"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Paged prefill against dense prefill, every way of fetching cached K/V, one run.

    python benchmarks/attention/bench_paged_prefill.py --out DIR [--commit SHA]
    python benchmarks/attention/bench_paged_prefill.py --smoke --out DIR   # CPU, interpreter

Cases (bf16, hdim 128, 16 heads, causal, 16k keys per batch, as in bench_attention.py):
  dense       4 x 4k prompts, the step's own K/V through TMA (the baseline);
  paged_all   4 x 4k, every key read from the paged cache through the block tables;
  chunked     4 x (3k cached + 1k new): the cached part paged, the new part fresh.
Each paged case runs for every page size, load mode (prefill_attention.PAGED_LOADS)
and tile config listed below; each output is checked against SDPA on the
contiguous K/V before it is timed. Timing: triton do_bench medians in
interleaved rounds (one timing of every candidate a round), median over rounds.
Writes DIR/paged_prefill.json and DIR/paged_prefill.md; prints the table last.
A time budget (--budget-s) skips the remaining candidates rather than overrun.
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

if "--smoke" in sys.argv:  # before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from slipstream.kernels.prefill_attention import prefill_attention  # noqa: E402

# name: tile config (explicit: no autotuning inside the comparison)
CONFIGS = {
    "M128_N128_s3": {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3},
    "M128_N128_s3_paired": {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3,
                            "PAIRED": True},
    "M128_N128_s2": {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2},
    "M128_N64_s3": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3},
    "M128_N64_s4": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 4},
    "M128_N64_s2_r128_tmastore_paired": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8,
                                         "num_stages": 2, "maxnreg": 128, "TMA_STORE": True,
                                         "PAIRED": True},
    "M128_N64_s2_r128_tmastore": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2,
                                  "maxnreg": 128, "TMA_STORE": True},
    # two programs an SM
    "M64_N64_w4_s3": {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
    "tuned": None,  # the autotuner over PREFILL_CONFIGS, as the engine runs it
}
DENSE_CONFIGS = ["M128_N128_s3", "M128_N128_s3_paired", "M128_N64_s2_r128_tmastore_paired"]
# (case, page size, load modes, configs), most important first (the budget cuts the tail).
PLAN = [
    ("paged_all", 16, ["shared"], ["M128_N128_s3"]),
    ("paged_all", 16, ["prefetch32", "prefetch32_one_loop"], ["M128_N128_s3", "M128_N128_s3_paired"]),
    ("paged_all", 16, ["prefetch32_lean"], ["M128_N128_s3", "M128_N128_s3_paired", "M128_N64_s3"]),
    ("paged_all", 16, ["prefetch32_one_loop_lean"], ["M128_N128_s3_paired"]),
    ("chunked", 16, ["shared"], ["M128_N128_s3", "M128_N64_s2_r128_tmastore_paired"]),
    ("chunked", 16, ["prefetch32"], ["M128_N128_s3", "M128_N128_s3_paired"]),
    ("chunked", 16, ["prefetch32_lean"], ["M128_N128_s3", "M128_N128_s3_paired",
                                          "M128_N64_s2_r128_tmastore_paired", "M128_N64_s2_r128_tmastore"]),
    ("chunked", 16, ["prefetch32_one_loop_lean"], ["M128_N128_s3"]),
    ("paged_all", 16, ["prefetch32_lean"], ["M128_N64_s2_r128_tmastore_paired", "M64_N64_w4_s3"]),
    ("paged_all", 128, ["tma", "tma_lean"], ["M128_N128_s3"]),
    ("chunked", 128, ["tma_lean"], ["M128_N128_s3"]),
    ("paged_all", 64, ["tma_lean"], ["M128_N64_s3"]),
    ("paged_all", 16, ["prefetch"], ["M128_N128_s3"]),
    ("chunked", 16, ["prefetch"], ["M128_N128_s3"]),
    # What the engine runs: the default fetch mode under the autotuner.
    ("paged_all", 16, ["default"], ["tuned"]),
    ("chunked", 16, ["default"], ["tuned"]),
]
SMOKE_CONFIG = {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 4, "num_stages": 2}
SMOKE_PAGES = {16: 8, 64: 16, 128: 32}  # pages below, at and above the smoke tile


def attn_flops(q_lens, k_lens, heads, head_dim) -> float:
    """4 * nq * nk * d per head; the causal square counts half (bench_attention.py)."""
    return sum(4 * heads * head_dim * (nq * (nk - nq) + nq * nq / 2) for nq, nk in zip(q_lens, k_lens))


def rel_err(out, ref) -> float:
    out, ref = out.double(), ref.double()
    return float("inf") if out.isnan().any() else ((out - ref).norm() / ref.norm()).item()


class Setup:
    """One case's data: q, the step's k/v (or None), a paged cache, and the reference."""

    def __init__(self, case, b, ctx, new, page, heads, d, dtype, dev, gen):
        total = ctx + new
        kc = torch.randn(b, total, heads, d, generator=gen).to(dev, dtype)
        vc = torch.randn(b, total, heads, d, generator=gen).to(dev, dtype)
        self.q = torch.randn(b * new, heads, d, generator=gen).to(dev, dtype)
        pages = total // page
        perm = torch.randperm(b * pages, generator=gen).to(dev)
        # A few spare blocks: the pool is not exactly the requests' pages.
        self.k_cache = torch.zeros(b * pages + 3, page, heads, d, dtype=dtype, device=dev)
        self.v_cache = torch.zeros_like(self.k_cache)
        self.k_cache[perm] = kc.reshape(b * pages, page, heads, d)
        self.v_cache[perm] = vc.reshape(b * pages, page, heads, d)
        self.tables = perm.view(b, pages).to(torch.int32)
        fresh = case != "paged_all"
        self.k = kc[:, ctx:].reshape(b * new, heads, d).contiguous() if fresh else None
        self.v = vc[:, ctx:].reshape(b * new, heads, d).contiguous() if fresh else None
        if case == "dense":  # no cache at all
            self.k_cache = self.v_cache = torch.empty(1, 16, heads, d, dtype=dtype, device=dev)
            self.tables = torch.zeros(b, 1, dtype=torch.int32, device=dev)
        self.cu = torch.arange(0, b + 1, dtype=torch.int32, device=dev) * new
        self.ctx = torch.full((b,), ctx, dtype=torch.int32, device=dev)
        self.new, self.out = new, torch.empty_like(self.q)
        self.flops = attn_flops([new] * b, [total] * b, heads, d)
        qb = self.q.view(b, new, heads, d).transpose(1, 2).float()
        mask = torch.ones(new, total, dtype=torch.bool, device=dev).tril(ctx)  # bottom-right causal
        ref = F.scaled_dot_product_attention(qb, kc.transpose(1, 2).float(), vc.transpose(1, 2).float(),
                                             attn_mask=mask, scale=d ** -0.5)
        self.ref = ref.transpose(1, 2).reshape_as(self.q)

    def fn(self, config, mode, use_tma=None):
        def run():
            return prefill_attention(self.q, self.k, self.v, self.k_cache, self.v_cache, self.cu,
                                     self.ctx, self.tables, self.new, self.q.shape[-1] ** -0.5,
                                     out=self.out, config=config, paged_load=mode,
                                     use_tma=use_tma)
        return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shapes, no timing")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=140.0)
    ap.add_argument("--commit", default="unknown")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    smoke = args.smoke

    def log(msg):
        print(f"[{time.time() - t0:6.1f}s] {msg}", flush=True)

    if smoke:
        dev, dtype, heads, d, batch, n, ctx_c = "cpu", torch.float32, 2, 32, 2, 64, 48
        configs = {name: SMOKE_CONFIG if c else None for name, c in CONFIGS.items()}
    else:
        dev, dtype, heads, d, batch, n, ctx_c = "cuda", torch.bfloat16, 16, 128, 4, 4096, 3072
        configs = CONFIGS
    shapes = {"dense": (0, n), "paged_all": (0, n), "chunked": (ctx_c, n - ctx_c)}
    res = {"meta": {"device": torch.cuda.get_device_name() if not smoke else "cpu (interpreter)",
                    "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "torch": torch.__version__, "commit": args.commit, "smoke": smoke,
                    "shape": {"batch": batch, "tokens": n, "heads": heads, "head_dim": d,
                              "chunked_context": ctx_c}},
           "rows": []}
    gen = torch.Generator().manual_seed(0)
    setups = {}

    def setup(case, page):
        if (case, page) not in setups:
            ctx, new = shapes[case]
            setups[(case, page)] = Setup(case, batch, ctx, new, SMOKE_PAGES[page] if smoke else page,
                                         heads, d, dtype, dev, gen)
        return setups[(case, page)]

    plan = [("dense", 16, ["shared"], DENSE_CONFIGS)] + PLAN
    timers = []
    for case, page, modes, cfgs in plan:
        s = setup(case, page)
        for mode in modes:
            for cname in cfgs:
                row = {"case": case, "page": page, "mode": mode if case != "dense" else "-",
                       "config": cname}
                res["rows"].append(row)
                if time.time() - t0 > args.budget_s:
                    row["skipped"] = "time budget"
                    continue
                # "/no_tma": Q and the output by pointers (as before TMA for k=None)
                fn = s.fn(configs[cname], None if mode == "default" else mode.split("/")[0],
                          use_tma=False if mode.endswith("/no_tma") else True if smoke else None)
                tc = time.time()
                try:
                    s.out.fill_(float("nan"))
                    fn()
                    if not smoke:
                        torch.cuda.synchronize()
                    row["compile_s"] = round(time.time() - tc, 2)
                    row["err"] = rel_err(s.out, s.ref)
                    row["ok"] = row["err"] < (2e-2 if dtype == torch.bfloat16 else 1e-4)
                except Exception as e:  # a config that fails is a result too
                    row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                    row["ok"] = False
                log(f"{case} page={page} {row['mode']} {cname}: "
                    + (f"err {row['err']:.2e}" if "err" in row else row["error"]))
                if row["ok"] and not smoke:
                    timers.append((row, fn, s.flops))
        (args.out / "paged_prefill.json").write_text(json.dumps(res, indent=1))

    if not smoke:
        import triton
        times = {id(r): [] for r, _, _ in timers}
        for rnd in range(args.rounds):
            for row, fn, _ in timers:
                times[id(row)].append(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))
            log(f"timing round {rnd + 1}/{args.rounds} done")
        for row, _, flops in timers:
            ts = times[id(row)]
            ms = statistics.median(ts)
            row.update(ms=ms, tflops=flops / ms / 1e9, spread=(max(ts) - min(ts)) / ms)
    summarize(res)
    (args.out / "paged_prefill.json").write_text(json.dumps(res, indent=1))
    md = markdown(res)
    (args.out / "paged_prefill.md").write_text(md)
    print(md)
    log("done")


def summarize(res) -> None:
    rows = [r for r in res["rows"] if r.get("tflops")]
    dense = max((r["tflops"] for r in rows if r["case"] == "dense"), default=None)
    res["dense_best_tflops"] = dense
    best = {}
    for r in rows:
        if dense:
            r["vs_dense"] = r["tflops"] / dense
        key = f"{r['case']} page {r['page']}"
        if key not in best or r["tflops"] > best[key]["tflops"]:
            best[key] = r
    res["best"] = {k: {"mode": r["mode"], "config": r["config"], "tflops": r["tflops"],
                       "vs_dense": r.get("vs_dense")} for k, r in best.items()}


def markdown(res) -> str:
    m = res["meta"]
    lines = [f"# Paged prefill ({m['device']}, {m['date_utc']}, commit {m['commit']})", "",
             f"Shape: {m['shape']}. Dense best: {res.get('dense_best_tflops') or 0:.0f} TFLOP/s.", "",
             "| case | page | mode | config | TFLOP/s | vs dense | spread | rel err | compile s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in res["rows"]:
        if "tflops" in r:
            t = f"{r['tflops']:.0f} | {r.get('vs_dense', 0):.2f}x | {r['spread']:.1%}"
        else:
            t = f"{r.get('skipped') or r.get('error') or '-'} | - | -"
        err = f"{r['err']:.1e}" if "err" in r else "-"
        lines.append(f"| {r['case']} | {r['page']} | {r['mode']} | {r['config']} | {t} | {err} | "
                     f"{r.get('compile_s', '-')} |")
    lines += ["", "Best per case:", ""]
    for k, b in res.get("best", {}).items():
        lines.append(f"- {k}: {b['mode']} {b['config']} {b['tflops']:.0f} TFLOP/s"
                     + (f" ({b['vs_dense']:.2f}x dense)" if b.get("vs_dense") else ""))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

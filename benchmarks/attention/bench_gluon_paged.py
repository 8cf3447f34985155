"""The Gluon prefill kernel over the engine's paged K/V cache, against its dense form
and the Triton kernel, on an H100/H200, in one run.

    python3 benchmarks/attention/bench_gluon_paged.py --out DIR

Cases (bf16, 16 heads, hdim 128, causal, 16k query tokens a step, as in GLUON.md):
  dense      4 x 4k whole prompts, K/V from the step (gluon_prefill, its default);
  paged_all  the same 4 x 4k, every key read from the cache through the block tables;
  chunked    4 x (3k cached + 1k new): the last chunk of each prompt, as chunked prefill
             and prefix hits run it;
  varlen     12 requests of 245-3091 tokens (GLUON.md's ragged batch), whole prompts,
             dense and paged.
Paged cases run with pages of 16 tokens (the engine's default) and 128. Each kernel's
output is first checked against an fp32 reference (relative error); then every
contender of a case is timed in interleaved rounds (do_bench medians, L2 flushed).
Writes DIR/gluon_paged.json and prints a table (TFLOP/s, ratio to dense).
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT), str(HERE)]

from timing import bench_ms, cu_seqlens, interleaved, rel_err  # noqa: E402

from slipstream.kernels import reference  # noqa: E402
from slipstream.kernels.gluon_prefill import gluon_prefill, gluon_prefill_paged  # noqa: E402
from slipstream.kernels.prefill_attention import prefill_attention  # noqa: E402

HEADS, D = 16, 128
SCALE = D ** -0.5
# The Triton kernel's config as autotuned on the H200 (bench_gluon_prefill.TRITON_CONFIG)
TRITON_CONFIG = {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3}
VARLEN = [245, 1011, 3091, 1600, 800, 2048, 1337, 512, 2500, 700, 1900, 1641]


def flops(q_lens, ctx_lens) -> float:
    """Causal attention FLOPs: 4 D x (keys each query sees), every head."""
    keys = sum(c * n + n * (n + 1) // 2 for n, c in zip(q_lens, ctx_lens))
    return 4.0 * HEADS * D * keys


class Case:
    """Queries of `q_lens` after `ctx` cached keys each; the full K/V in a paged cache."""

    def __init__(self, q_lens, ctx, page, gen):
        self.q_lens, self.ctx = q_lens, ctx
        kv_lens = [c + n for c, n in zip(ctx, q_lens)]
        pages = [-(-n // page) for n in kv_lens]
        perm = torch.randperm(sum(pages) + 3, generator=gen).cuda()
        self.tables = torch.zeros(len(q_lens), max(pages), dtype=torch.int32, device="cuda")
        self.k_cache = torch.zeros(sum(pages) + 3, page, HEADS, D, dtype=torch.bfloat16, device="cuda")
        self.v_cache = torch.zeros_like(self.k_cache)
        self.k_new, self.v_new, used = [], [], 0
        for i, (n_keys, n_pages) in enumerate(zip(kv_lens, pages)):
            self.tables[i, :n_pages] = perm[used:used + n_pages].int()
            used += n_pages
            k, v = (torch.randn(n_keys, HEADS, D, dtype=torch.bfloat16, device="cuda")
                    for _ in range(2))
            pos = torch.arange(n_keys, device="cuda")
            slots = self.tables[i, pos // page].long() * page + pos % page
            self.k_cache.flatten(0, 1)[slots] = k
            self.v_cache.flatten(0, 1)[slots] = v
            self.k_new.append(k[ctx[i]:])
            self.v_new.append(v[ctx[i]:])
        self.k_new, self.v_new = torch.cat(self.k_new), torch.cat(self.v_new)
        self.q = torch.randn(sum(q_lens), HEADS, D, dtype=torch.bfloat16, device="cuda")
        self.cu = cu_seqlens(q_lens, "cuda")
        self.kv_lens = torch.tensor(kv_lens, dtype=torch.int32, device="cuda")
        self.ctx_t = torch.tensor(ctx, dtype=torch.int32, device="cuda")
        self.out = torch.empty_like(self.q)
        self.flops = flops(q_lens, ctx)

    def reference(self) -> torch.Tensor:
        return reference.paged_attention(self.q.float(), self.k_cache.float(), self.v_cache.float(),
                                         self.cu.tolist(), self.kv_lens.tolist(), self.tables, SCALE,
                                         None)

    def contenders(self) -> dict:
        m = max(self.q_lens)
        c = {"gluon paged": lambda: gluon_prefill_paged(
                 self.q, self.k_cache, self.v_cache, self.cu, self.kv_lens, self.tables, m, SCALE,
                 out=self.out),
             "triton paged": lambda: prefill_attention(
                 self.q, None, None, self.k_cache, self.v_cache, self.cu, self.ctx_t,
                 self.tables, m, SCALE, causal=True, out=self.out, config=TRITON_CONFIG),
             # the engine's Triton path: the step's own K/V from the step, the context paged
             "triton step": lambda: prefill_attention(
                 self.q, self.k_new, self.v_new, self.k_cache, self.v_cache, self.cu, self.ctx_t,
                 self.tables, m, SCALE, causal=True, out=self.out, config=TRITON_CONFIG)}
        if not any(self.ctx):
            c["gluon dense"] = lambda: gluon_prefill(self.q, self.k_new, self.v_new, self.cu, m, SCALE,
                                                     out=self.out, lengths=self.q_lens)
        return c


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    cases = [("paged_all 4x4k", [4096] * 4, [0] * 4), ("chunked 4x(3k+1k)", [1024] * 4, [3072] * 4),
             ("varlen 12", VARLEN, [0] * len(VARLEN))]
    rows = []
    for page in (16, 128):
        for name, q_lens, ctx in cases:
            case = Case(q_lens, ctx, page, gen)
            ref = case.reference()
            timers, checks = {}, {}
            for label, fn in case.contenders().items():
                try:
                    fn()
                    torch.cuda.synchronize()
                    checks[label] = rel_err(case.out.float(), ref.float())
                    timers[label] = (lambda f: lambda: bench_ms(f))(fn)
                except Exception as e:  # noqa: BLE001 - reported, left out of the timing
                    checks[label] = f"{type(e).__name__}: {e}"[:300]
            times = interleaved(timers, a.rounds) if timers else {}
            row = {"case": name, "page": page, "q_lens": q_lens, "ctx": ctx, "rel_err": checks,
                   "ms": {k: v["ms"] for k, v in times.items()},
                   "spread": {k: v["spread"] for k, v in times.items()},
                   "tflops": {k: case.flops / v["ms"] / 1e9 for k, v in times.items()}}
            rows.append(row)
            print(name, f"page {page}", {k: round(v, 1) for k, v in row["tflops"].items()},
                  {k: (round(v, 5) if isinstance(v, float) else v) for k, v in checks.items()},
                  flush=True)
            del case
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": __import__("triton").__version__, "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                     capture_output=True, text=True).stdout.strip()}
    (out_dir / "gluon_paged.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print("\n| case | page | gluon paged | gluon dense | triton paged | triton step | "
          "gluon paged / dense | / triton step |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        t = r["tflops"]
        gp, gd, tp, ts = (t.get(k) for k in ("gluon paged", "gluon dense", "triton paged", "triton step"))
        f = lambda x: f"{x:.0f}" if x else "-"  # noqa: E731
        g = lambda x, y: f"{x / y:.2f}" if x and y else "-"  # noqa: E731
        print(f"| {r['case']} | {r['page']} | {f(gp)} | {f(gd)} | {f(tp)} | {f(ts)} | {g(gp, gd)} | "
              f"{g(gp, ts)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

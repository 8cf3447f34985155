"""Weights into L2 on a side stream ahead of their matmul: does it pay?

    python benchmarks/runtime/bench_l2_prefetch.py --out DIR [--smoke]

At batch 1 a decode step spends about a tenth of its time in kernels that leave HBM
idle (rotary + KV store, attention over a short context, norms, SiLU, split-K
reductions), and the weights the next matmul streams are known in advance. The idea
measured here: a small kernel on a second stream asks L2 for them (`prefetch.global.L2`,
nothing comes back to registers) while those kernels run.

A CUDA graph runs 16 "layers" of Llama-3-8B's four weight shapes at 1 and 64 rows,
each a latency-bound kernel of T us (a spin on one program: attention's stand-in)
followed by cuBLAS on its own copy of the weight (16 copies: L2 holds none of them when
its turn comes). Variants: no prefetch; the weight asked for on a side stream forked
when the spin starts (whole, with evict_last lines, the first half, one line in two);
and the matmul alone after a prefetch that has landed. Reports us per layer.

The engine-level A/B of the same idea (the hooks in the Llama forward, plans over
o_proj / gate_up / down / qkv, the decode graphs captured again under each plan) ran at
commit 2c94a13 (`--stages engine` there); both runs are in results/.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}


def _spin_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def spin(out, ns):
        t0 = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                       is_pure=False, pack=1)
        t = t0
        while t - t0 < ns:
            t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [],
                                          dtype=tl.int64, is_pure=False, pack=1)
        tl.store(out, t - t0)
    return spin


def _prefetcher():
    """prefetch_l2(t, nbytes=None, every=1, evict_last=False): ask L2 for the first
    `nbytes` of contiguous `t`, one 128-byte line in `every`."""
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(P, n_lines, step_bytes, LINES: tl.constexpr, EVICT_LAST: tl.constexpr):
        i = tl.minimum(tl.program_id(0) * LINES + tl.arange(0, LINES), n_lines - 1)
        ptrs = P + i.to(tl.int64) * step_bytes
        if EVICT_LAST:
            tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;",
                                      "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;",
                                      "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1)

    def prefetch_l2(t, nbytes=None, every=1, evict_last=False):
        size = t.numel() * t.element_size()
        span = size if nbytes is None else min(int(nbytes), size)
        n_lines = span // (128 * every)
        if n_lines > 0:
            kernel[(triton.cdiv(n_lines, 1024),)](t.view(-1).view(torch.uint8), n_lines,
                                                 128 * every, LINES=1024,
                                                 EVICT_LAST=evict_last, num_warps=4)
    return prefetch_l2


def _graph_us(fn) -> float:
    """Microseconds per replay of a CUDA graph of fn() (median of 20)."""
    from benchmarks.cuda_timing import graph_timer
    return graph_timer([fn], min_calls=1, replays=20)() * 1e3


def stage_micro(smoke: bool) -> dict:
    import torch
    spin = _spin_kernel()
    prefetch_l2 = _prefetcher()
    dev = torch.device("cuda")
    side = torch.cuda.Stream(dev)
    clock = torch.zeros(1, dtype=torch.int64, device=dev)
    copies = 4 if smoke else 16
    rows = []
    variants = {"none": None, "whole": (None, 1, False), "whole_evict_last": (None, 1, True),
                "first_half": ("half", 1, False), "every_2nd_line": (None, 2, False)}
    for name, (n, k) in SHAPES.items():
        if smoke:
            n, k = n // 16, k // 16
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
        size = n * k * 2
        for m in (1, 64):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            for spin_us in (0, 3, 8):
                res = {"weight": name, "shape": [n, k], "rows": m, "spin_us": spin_us,
                       "weight_MB": size / 1e6}
                for vname, v in variants.items():
                    def layers():
                        main = torch.cuda.current_stream()
                        for w in ws:
                            if v is not None:
                                side.wait_stream(main)
                                with torch.cuda.stream(side):
                                    prefetch_l2(w, size // 2 if v[0] == "half" else None, v[1],
                                                v[2])
                            if spin_us:
                                spin[(1,)](clock, spin_us * 1000)
                            torch.nn.functional.linear(x, w)
                        if v is not None:
                            main.wait_stream(side)
                    res[vname + "_us"] = _graph_us(layers) / copies
                if spin_us == 0:   # the matmul after a landed prefetch; after the same wait alone
                    def fetched():
                        for w in ws:
                            prefetch_l2(w)
                            spin[(1,)](clock, 20_000)   # the prefetch has landed
                            torch.nn.functional.linear(x, w)
                    def waited():
                        for w in ws:
                            spin[(1,)](clock, 20_000)
                            torch.nn.functional.linear(x, w)
                    res["after_prefetch_us"] = _graph_us(fetched) / copies - 20
                    res["after_spin_us"] = _graph_us(waited) / copies - 20
                rows.append(res)
                print(json.dumps(res), flush=True)
        del ws
        torch.cuda.empty_cache()
    return {"rows": rows}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--smoke", action="store_true", help="small shapes (still on a GPU)")
    a = ap.parse_args()
    import torch
    import triton
    a.out.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "date": time.strftime("%Y-%m-%d")}
    try:
        meta["commit"] = (ROOT / "COMMIT").read_text().strip()
    except OSError:
        pass
    t0 = time.perf_counter()
    res = stage_micro(a.smoke)
    res.update(meta, stage_seconds=time.perf_counter() - t0)
    (a.out / "l2_prefetch_micro.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The greedy argmax over logit rows on the CPU: torch's one-pass argmax against
`layers/argmax.row_argmax`'s two passes (the maxima of a few long chunks, then
the argmax of those), at the rows a plain step (1), a chain of 3 drafts (4) and a
tree (16) verify, over the vocabularies of SmolLM2 (49,152), Llama-2 (32,000),
Llama-3 (128,256) and Qwen2 (151,936). Each result is checked equal first.

    python benchmarks/cpu/bench_argmax.py --out benchmarks/cpu/results
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def _us(fn, n: int = 300) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def _cpu_name() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "")
    flags = set(next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), []))
    return f"{name} ({', '.join(f for f in ('avx2', 'avx512f', 'avx512_bf16', 'amx_tile') if f in flags)})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch
    from slipstream.layers.argmax import _argmax_chunks, row_argmax

    rows_out = []
    for vocab in (49152, 32000, 128256, 151936):
        chunks = _argmax_chunks(vocab, cuda=False)
        for rows in (1, 4, 16):
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows)).to(dtype)
                assert torch.equal(row_argmax(x), x.argmax(dim=-1))
                one, two = _us(lambda: x.argmax(dim=-1)), _us(lambda: row_argmax(x))
                rows_out.append(dict(vocab=vocab, rows=rows, dtype=str(dtype).replace("torch.", ""),
                                     chunks=chunks, one_pass_us=round(one, 1),
                                     two_pass_us=round(two, 1), speedup=round(one / two, 2)))
                print(rows_out[-1], flush=True)
    res = dict(date=datetime.date.today().isoformat(), cpu=_cpu_name(),
               threads=torch.get_num_threads(), cores=os.cpu_count(), torch=torch.__version__,
               rows=rows_out)
    lines = [f"# Greedy argmax on the CPU ({res['date']}, {res['cpu']}, {res['cores']} cores, "
             f"torch {res['torch']}, {res['threads']} threads)", "",
             "| vocabulary | rows | dtype | chunks | one pass us | two passes us | speedup |",
             "| ---: | ---: | --- | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['vocab']} | {r['rows']} | {r['dtype']} | {r['chunks']} | {r['one_pass_us']} | "
              f"{r['two_pass_us']} | {r['speedup']}x |" for r in rows_out]
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        stem = f"argmax_{res['date']}"
        (out / f"{stem}.json").write_text(json.dumps(res, indent=1))
        (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

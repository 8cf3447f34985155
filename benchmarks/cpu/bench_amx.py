"""AMX tiles (kernels/cpu_amx.c) against the AVX-512 kernel on this CPU, default model.

The tiles take Q8_0 products of 8+ rows of x and Q4_0 / Q4_1 ones of 16+; the
default model's decoder layers are Q4_1, its LM head Q8_0.
1. Products: the 30 decoder layers' products and the LM head, for m rows of x, tiles
   on and off alternating rep by rep; medians.
2. Prefill of one prompt through `LLM.generate` (max_tokens=1), after prompts that
   touch the KV pool's pages, tiles on and off alternating; medians -> prompt tokens/s.
3. Decode of 16 requests at once through `LLM.generate` (the LM head at 16 rows a
   step), 64 greedy tokens each, tiles on and off alternating; medians -> tokens/s.
4. The same model with its Q4_1 tensors requantized to Q8_0 (a GGUF file written to a
   temporary folder: the format llama.cpp users run 8-bit models in; weights differ
   from the Q4_1 file's by Q8_0's rounding): 2 and 3 again.

    python benchmarks/cpu/bench_amx.py --out benchmarks/cpu/results

Exits with a note where this CPU, its compiler or the OS gives no AMX tiles.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def _median_ms(fn, reps: int) -> float:
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def products(llm, ms: list[int], reps: int) -> list[dict]:
    import torch
    from slipstream.kernels import cpu_library
    from slipstream.kernels.cpu_quant import QuantMatrix
    model = llm.engine.runner.model

    def blocks(mod):
        w = getattr(mod, "gguf_weight", None)
        return w if isinstance(w, QuantMatrix) else None
    mats = [blocks(mod) for name, mod in model.named_modules()
            if name.startswith("model.layers.") and blocks(mod) is not None]
    head = blocks(model.lm_head) or blocks(model.model.embed_tokens)   # a tied head: the table
    if not mats:
        raise SystemExit("the model's layers hold no CPU blocks (not the GGUF path?)")
    rows = []
    for m in ms:
        xs = {w.cols: torch.randn(m, w.cols) for w in mats + ([head] if head else [])}
        times = {(part, amx): [] for part in ("layers", "lm_head") for amx in (False, True)}
        for _ in range(reps):
            for amx in (False, True):
                cpu_library.set_amx(amx)
                times[("layers", amx)].append(_median_ms(lambda: [w.matmul(xs[w.cols]) for w in mats], 1))
                if head is not None:
                    times[("lm_head", amx)].append(_median_ms(lambda: head.matmul(xs[head.cols]), 1))
        for part in ("layers", "lm_head"):
            if not times[(part, False)]:
                continue
            off, on = (statistics.median(times[(part, a)]) for a in (False, True))
            rows.append({"part": part, "m": m, "avx512_ms": round(off, 3), "amx_ms": round(on, 3),
                         "speedup": round(off / on, 3)})
    cpu_library.set_amx(True)
    return rows


def batch_decode(llm, batch: int, tokens: int, reps: int) -> dict:
    from slipstream import SamplingParams
    from slipstream.kernels import cpu_library
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(16)]}
               for _ in range(batch)]
    llm.generate(prompts, params, use_tqdm=False)          # warm-up
    times = {amx: [] for amx in (False, True)}
    outs = {}
    for _ in range(reps):
        for amx in (False, True):
            cpu_library.set_amx(amx)
            t = time.perf_counter()
            outs[amx] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            times[amx].append(time.perf_counter() - t)
    cpu_library.set_amx(True)
    off, on = (statistics.median(times[a]) for a in (False, True))
    same = sum(a == b for a, b in zip(outs[False], outs[True])) / batch
    return {"batch": batch, "tokens": tokens, "avx512_tok_s": round(batch * tokens / off, 1),
            "amx_tok_s": round(batch * tokens / on, 1), "speedup": round(off / on, 3),
            "identical_outputs": same}


def q8_0_copy(src: Path, dst: Path) -> Path:
    """src's GGUF with every Q4_0 / Q4_1 tensor dequantized and quantized again as Q8_0."""
    import gguf
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        vt = field.types[0]
        sub = field.types[-1] if vt == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vt, sub_type=sub)
    q4 = (gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1)
    for t in reader.tensors:
        if t.tensor_type in q4:
            dense = gguf.quants.dequantize(t.data, t.tensor_type)
            data = gguf.quants.quantize(dense, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(t.name, data, raw_shape=data.shape,
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def prefill(llm, lengths: list[int], reps: int) -> list[dict]:
    from slipstream import SamplingParams
    from slipstream.kernels import cpu_library
    params = SamplingParams(max_tokens=1, temperature=0)
    rng = random.Random(0)
    # A prompt's KV blocks are fresh memory until the pool has cycled through them once,
    # and a first write to a page faults: fill the pool's pages first.
    blocks = llm.engine.runner.num_blocks * llm.engine.config.cache.block_size
    for _ in range(min(64, blocks // max(lengths) + 2)):
        llm.generate([{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(max(lengths))]}],
                     params, use_tqdm=False)
    times = {(n, amx): [] for n in lengths for amx in (False, True)}
    for _ in range(reps):
        for amx in (False, True):
            cpu_library.set_amx(amx)
            for n in lengths:
                ids = [rng.randrange(100, 40000) for _ in range(n)]
                times[(n, amx)].append(_median_ms(lambda: llm.generate(
                    [{"prompt_token_ids": ids}], params, use_tqdm=False), 1))
    cpu_library.set_amx(True)
    rows = []
    for n in lengths:
        off, on = (statistics.median(times[(n, a)]) for a in (False, True))
        rows.append({"prompt_tokens": n, "avx512_tok_s": round(n / off * 1e3, 1),
                     "amx_tok_s": round(n / on * 1e3, 1), "speedup": round(off / on, 3)})
    return rows


def markdown(meta: dict, prod: list[dict], pre: list[dict], dec: dict, q8_prefill: list[dict],
             q8_dec: dict) -> str:
    lines = [f"# AMX tiles against AVX-512 ({meta['cpu']})", "",
             f"{meta['date']}, {meta['threads']} threads, torch {meta['torch']}, commit "
             f"{meta['commit']}; load average {meta['load_before']} -> {meta['load_after']}. "
             "Tiles on and off alternating rep by rep; medians.", "",
             "## Default model: products (the 30 decoder layers' Q4_1 products; the Q8_0 "
             "LM head)", "",
             "| part | rows of x | AVX-512 ms | AMX ms | speedup |", "| --- | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['part']} | {r['m']} | {r['avx512_ms']} | {r['amx_ms']} | {r['speedup']} |"
              for r in prod]
    lines += ["", "## Default model: prefill of one prompt (max_tokens=1)", "",
              "| prompt tokens | AVX-512 tok/s | AMX tok/s | speedup |", "| ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['prompt_tokens']} | {r['avx512_tok_s']} | {r['amx_tok_s']} | {r['speedup']} |"
              for r in pre]
    for title, d in ((f"Default model: decode, {dec['batch']} requests at once", dec),
                     (f"The model requantized to Q8_0: decode, {q8_dec['batch']} requests at once",
                      q8_dec)):
        lines += ["", f"## {title} ({d['tokens']} greedy tokens each, `LLM.generate`)", "",
                  "| AVX-512 tok/s | AMX tok/s | speedup | identical outputs |",
                  "| ---: | ---: | ---: | ---: |",
                  f"| {d['avx512_tok_s']} | {d['amx_tok_s']} | {d['speedup']} | "
                  f"{d['identical_outputs']} |"]
    lines += ["", "## The model requantized to Q8_0: prefill of one prompt (max_tokens=1)", "",
              "| prompt tokens | AVX-512 tok/s | AMX tok/s | speedup |", "| ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['prompt_tokens']} | {r['avx512_tok_s']} | {r['amx_tok_s']} | {r['speedup']} |"
              for r in q8_prefill]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--ms", default="1,4,8,12,16,32,64")
    ap.add_argument("--prompts", default="32,128,512")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    import subprocess
    import torch
    from slipstream import LLM
    from slipstream.kernels import cpu_library
    llm = LLM()
    if not cpu_library.set_amx():
        print("no AMX tiles here (CPU, compiler or OS); nothing to compare")
        return 0
    load_before = os.getloadavg()[0]
    prod = products(llm, [int(m) for m in args.ms.split(",")], args.reps)
    pre = prefill(llm, [int(n) for n in args.prompts.split(",")], args.reps)
    dec = batch_decode(llm, args.batch, args.tokens, args.reps)
    del llm
    import tempfile
    from slipstream.loader import default_model_path
    with tempfile.TemporaryDirectory() as tmp:
        q8 = LLM(str(q8_0_copy(default_model_path(), Path(tmp) / "smollm2-135m-instruct.q8_0.gguf")))
        q8_prefill = prefill(q8, [int(n) for n in args.prompts.split(",")], args.reps)
        q8_dec = batch_decode(q8, args.batch, args.tokens, args.reps)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip() or "unknown"
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "cpu": platform.processor() or platform.machine(), "threads": cpu_library.threads(),
            "torch": torch.__version__, "commit": commit, "load_before": round(load_before, 2),
            "load_after": round(os.getloadavg()[0], 2)}
    md = markdown(meta, prod, pre, dec, q8_prefill, q8_dec)
    print(md)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        stem = f"amx_{meta['date'][:10]}_{commit}"
        (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "products": prod, "prefill": pre, "decode": dec,
                                                       "q8_0_prefill": q8_prefill, "q8_0_decode": q8_dec},
                                                      indent=1))
        (out / f"{stem}.md").write_text(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Perplexity of the default model with a quantized KV cache (CPU, real weights).

Same model, text, windows and scoring as quality.py (its baseline row is this
one's): benchmarks/quant/eval_text.txt in non-overlapping windows of --context
tokens, scored by the engine itself (`LLM.generate` with prompt_logprobs).

* kv-int8, kv-fp8: the engine's own path, `kv_cache_dtype="int8"` / `"fp8"`, on the
  torch attention backend, where every query token, a prompt's included, attends
  to keys and values read back from the quantized cache: the numerics of a decode
  step at every position (the Triton prefill kernel would read a prompt's own
  keys at full precision, so this is the stricter measure).
* kivi4 / kivi2 (KIVI, reference path): each query attends to the cache as it
  stood at its own step (quant/kivi.py, `kivi_causal_attention`): keys per
  channel over groups of 32 tokens, values per token, the incomplete group and
  the last --kivi-residual tokens exact.
* engine-kivi4 / engine-kivi2: the engine's own KIVI cache (`kv_cache_dtype`
  "kivi4" / "kivi2", cache/kivi_paged.py, torch backend), blocks of 32 tokens
  (a key group each), the block being filled and the last complete one (32
  tokens) exact. The windows are scored in prompt chunks of 32 tokens (chunked
  prefill): a chunk's queries see the earlier chunks as the cache holds them and
  their own chunk exact (as KIVI computes a prompt before quantizing its cache),
  which is KIVI's decode-time view at the granularity of a key group.

    PYTHONPATH=. python benchmarks/quant/kv_quality.py [--out benchmarks/quant/results]
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from quality import perplexity  # noqa: E402

ROWS = {
    "baseline": ({}, "fp32 weights (the Q4_1 GGUF dequantized at load), fp32 KV cache"),
    "kv-int8": ({"kv_cache_dtype": "int8"}, "int8 KV cache, one scale per token and head"),
    "kv-fp8": ({"kv_cache_dtype": "fp8"}, "fp8 e4m3 KV cache, one scale per token and head"),
    "kivi4": ({"kivi": 4}, "KIVI 4-bit: keys per channel (groups of 32 tokens), values per token"),
    "kivi2": ({"kivi": 2}, "KIVI 2-bit: keys per channel (groups of 32 tokens), values per token"),
    "engine-kivi4": ({"kv_cache_dtype": "kivi4", "block_size": 32, "max_num_batched_tokens": 32},
                     "KIVI 4-bit through the engine (kv_cache_dtype='kivi4'), blocks of 32, "
                     "the block being filled and the last full one exact, prompts in chunks of 32"),
    "engine-kivi2": ({"kv_cache_dtype": "kivi2", "block_size": 32, "max_num_batched_tokens": 32},
                     "KIVI 2-bit through the engine (kv_cache_dtype='kivi2'), blocks of 32, "
                     "the block being filled and the last full one exact, prompts in chunks of 32"),
}


def use_kivi(llm, bits: int, group: int, residual: int) -> None:
    """Every attention layer computes KIVI's decode-time numerics for whole prompts."""
    from slipstream.quant.kivi import kivi_causal_attention
    for layer in llm.engine.runner.model.attention_layers():
        def forward(q, k, v, batch, layer=layer):
            # whole prompts only (no chunking, no cached context): the windows are scored
            # with chunked prefill off and no prefix cache
            assert batch.seq_lens_cpu == batch.query_lens_cpu, "KIVI path: whole prompts only"
            out, start = torch.empty_like(q), 0
            for n in batch.query_lens_cpu:
                out[start:start + n] = kivi_causal_attention(
                    q[start:start + n], k[start:start + n], v[start:start + n], layer.scale,
                    bits, group, residual)
                start += n
            return out
        layer.forward = forward


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--kivi-group", type=int, default=32)
    ap.add_argument("--kivi-residual", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from slipstream import LLM
    from slipstream.loader import default_model_path, open_model
    model = str(default_model_path())
    tok = open_model(model).tokenizer()
    ids = tok.encode((HERE / "eval_text.txt").read_text(encoding="utf-8"))
    windows = [ids[i:i + args.context] for i in range(0, len(ids), args.context)]
    windows = [w for w in windows if len(w) > 1]
    # Dense fp32 weights (the GGUF's Q4_1 blocks dequantized at load), as quality.py's
    # rows: the GGUF CPU kernels would add their own activation rounding.
    opts = dict(dtype="float32", device="cpu", max_model_len=args.context + 8,
                enable_prefix_caching=False, quantization=None)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "kv_cache_quality.json"
    old = json.loads(path.read_text())["results"] if path.is_file() else []
    rows = {r["method"]: r for r in old}
    for name in args.rows.split(","):
        spec, desc = ROWS[name]
        t0 = time.perf_counter()
        if "kivi" in spec:
            llm = LLM(model, **opts, enable_chunked_prefill=False,
                      max_num_batched_tokens=args.context + 8)
            use_kivi(llm, spec["kivi"], args.kivi_group, args.kivi_residual)
            desc += f", last {args.kivi_residual} tokens exact (reference path)"
        else:
            llm = LLM(model, **opts, **spec)
        ppl, nll = perplexity(llm, windows)
        n = len(nll)
        del llm
        rows[name] = {"method": name, "description": desc, "ppl": ppl, "tokens": n,
                      "seconds": round(time.perf_counter() - t0, 1)}
        print(f"{name:10s} ppl {ppl:8.4f} ({n} tokens, {rows[name]['seconds']:.0f} s)", flush=True)
    order = [r for r in ROWS if r in rows]
    results = [rows[r] for r in order]
    base = rows.get("baseline", {}).get("ppl")
    meta = {"model": "SmolLM2-135M-Instruct (Q4_1 GGUF dequantized to dense fp32 at load)",
            "text": "benchmarks/quant/eval_text.txt", "context": args.context,
            "scoring": "non-overlapping windows, first token of each window unscored",
            "attention": "torch backend: every query reads K/V back from the (quantized) cache",
            "machine": platform.processor() or platform.machine(), "torch": torch.__version__}
    path.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    lines = ["# Perplexity by KV cache format\n",
             f"{meta['model']}; text {meta['text']}, {results[0]['tokens']} tokens scored, windows "
             f"of {args.context} ({meta['scoring']}); {meta['attention']}.\n",
             "| KV cache | description | ppl | vs baseline | target |", "| --- | --- | ---: | ---: | --- |"]
    for r in results:
        rel = r["ppl"] / base - 1 if base else None
        target = ""
        if r["method"] == "kv-int8" and rel is not None:
            target = f"within 0.5%: {'met' if abs(rel) <= 0.005 else 'not met'}"
        lines.append(f"| {r['method']} | {r['description']} | {r['ppl']:.4f} | "
                     f"{'' if rel is None else f'{100 * rel:+.2f}%'} | {target} |")
    (out / "kv_cache_quality.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""End-to-end decode and prefill through the engine by weight format: Llama-3-8B shape,
random weights (`load_format="dummy"`), H200.

Each scheme runs in a fresh process (so one model's memory never meets the next):

    LLM("llama-3-8b", load_format="dummy", quantization=SCHEME, dtype="bfloat16",
        max_num_seqs=1, enable_prefix_caching=False)

bf16 (dense), rtn-int4 (w4a16: int4 group 128 asymmetric; the LM head stays bf16, as GPTQ
and AWQ checkpoints keep it), rtn-int4-head8 (the same with the LM head in int8 per output
channel), int8 (w8a16: int8 per output channel), int8-head8 (the same with the LM head in
int8), w8a8 (W8A8 int8, per-token dynamic
activations), fp8 (W8A8 float8 e4m3). The
engine quantizes the random bf16 weights at load by the scheme's own path, warms up (memory
profiling, which also tunes the quantized GEMMs' launch configurations), captures its decode
CUDA graphs, and is then timed as a user sees it (scheduler, sampler and host work included):

* decode at batch 1: a 128-token prompt of random ids, 128 tokens generated (greedy,
  ignore_eos); the same with fresh ids to the first token only (the prefill); decode step =
  (whole - prefill) / 127; median of --iters runs -> tokens/s;
* prefill: a 2048-token prompt of fresh random ids to its first token; median of --iters
  -> prompt tokens/s.

Sanity before timing: every generated id lies in the vocabulary and the first 32 greedy ids
are compared with the bf16 engine's (random weights make quantization flip near-ties, so the
agreement is recorded, not asserted; correctness of the kernels is bench_quant_gemm.py's job).
Targets (issue): int4 decode >= 3x bf16, int8 (w8a16) >= 1.7x, W8A8 prefill >= 1.5x.

    python benchmarks/quant/bench_decode_step.py [--out DIR]     # H200, about 2-3 minutes
    PYTHONPATH=. python benchmarks/quant/bench_decode_step.py --smoke --out /tmp/q   # CPU
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.quant.child_runs import bench_model, child_env, run_child  # noqa: E402
SCHEMES = ["bf16", "rtn-int4", "rtn-int4-head8", "int8", "int8-head8", "w8a8", "fp8"]
# A scheme with ":loop" runs its 4-bit layers on the fp32-loop GEMV (kernels/int_weight_gemv.py)
# instead of the tensor-core one (kernels/w4_mma_gemv.py): SLIPSTREAM_W4_MMA=0 in its process.
# ":pdl": the tensor-core GEMV launched early (programmatic dependent launch; off by default).
# ":tma": the 8-bit layers' one-row products with the TMA GEMV among the tuner's launches
# (kernels/tma_int8_gemv.py; SLIPSTREAM_TMA_INT8_GEMV=1, off by default).
VARIANT_ENV = {"loop": {"SLIPSTREAM_W4_MMA": "0"}, "pdl": {"SLIPSTREAM_W4_MMA_PDL": "1"},
               "tma": {"SLIPSTREAM_TMA_INT8_GEMV": "1"}}
TINY_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512,
               "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2,
               "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
               "torch_dtype": "float32"}


def _run(engine, prompts, params) -> tuple[float, list]:
    outs = {}
    for p in prompts:
        engine.add_request({"prompt_token_ids": p}, params)
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = list(o.outputs[0].token_ids)
    return time.perf_counter() - t0, list(outs.values())


def one_scheme(scheme: str, smoke: bool, iters: int, model: str) -> dict:
    import torch

    from slipstream import LLM, SamplingParams
    device = "cpu" if smoke else "cuda"
    prompt_len, gen, prefill_len = (16, 12, 64) if smoke else (128, 128, 2048)
    t0 = time.perf_counter()
    scheme = scheme.split(":")[0]
    llm = LLM(model, load_format="dummy", quantization=None if scheme == "bf16" else scheme,
              dtype="float32" if smoke else "bfloat16", device=device, max_num_seqs=1,
              max_model_len=prefill_len + 64, max_num_batched_tokens=prefill_len,
              enable_prefix_caching=False, gpu_memory_utilization=0.85)
    engine = llm.engine
    vocab = engine.config.model_config.vocab_size
    startup = time.perf_counter() - t0
    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(0, vocab, (n,), generator=g).tolist()  # noqa: E731
    greedy = SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True)
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    fixed = torch.randint(0, vocab, (prompt_len,), generator=torch.Generator().manual_seed(7))
    _, (ids,) = _run(engine, [fixed.tolist()], greedy)          # warm-up + sanity sample
    _run(engine, [rand(prefill_len)], first)     # the prefill's shapes compiled and tuned untimed
    steps, prefills = [], []
    for _ in range(iters):
        whole, _ = _run(engine, [rand(prompt_len)], greedy)
        pre, _ = _run(engine, [rand(prompt_len)], first)
        steps.append((whole - pre) / (gen - 1))
        prefills.append(_run(engine, [rand(prefill_len)], first)[0])
    step, pre = statistics.median(steps), statistics.median(prefills)
    return {"scheme": scheme, "startup_s": startup, "decode_step_ms": step * 1e3,
            "decode_tokens_per_s": 1.0 / step, "decode_steps_ms": [s * 1e3 for s in steps],
            "prefill_tokens": prefill_len, "prefill_ms": pre * 1e3,
            "prefill_tokens_per_s": prefill_len / pre, "ids_in_vocab": all(0 <= i < vocab for i in ids),
            "first_ids": ids[:32], "device": torch.cuda.get_device_name() if device == "cuda"
            else "cpu", "torch": torch.__version__}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--smoke", action="store_true", help="tiny random model on the CPU")
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)      # child: one scheme
    ap.add_argument("--json", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        res = one_scheme(args.one, args.smoke, args.iters, args.model)
        Path(args.json).write_text(json.dumps(res))
        return 0
    tmp = Path(tempfile.mkdtemp())
    model = bench_model(tmp, args.smoke, TINY_CONFIG)
    rows = []
    for scheme in args.schemes.split(","):
        base_name, _, variant = scheme.partition(":")
        if base_name not in SCHEMES or (variant and variant not in VARIANT_ENV):
            raise ValueError(f"--schemes: unknown {scheme!r}; choose from {SCHEMES}, "
                             f"optionally with :{' :'.join(VARIANT_ENV)}")
        r = {**run_child(__file__, scheme, model, args.iters, args.smoke, tmp,
                         child_env(VARIANT_ENV.get(variant))), "scheme": scheme}
        rows.append(r)
        if r.get("failed"):
            continue
        print(f"{scheme:9s} decode b=1 {r['decode_tokens_per_s']:8.1f} tok/s "
              f"({r['decode_step_ms']:.3f} ms/step)  prefill {r['prefill_tokens']} "
              f"{r['prefill_tokens_per_s']:9.0f} tok/s  (process {r['wall_s']:.0f} s, engine "
              f"start {r['startup_s']:.0f} s)", flush=True)
    base = next((r for r in rows if r["scheme"] == "bf16" and not r.get("failed")), None)
    for r in rows:
        if base and not r.get("failed"):
            r["decode_speedup_vs_bf16"] = r["decode_tokens_per_s"] / base["decode_tokens_per_s"]
            r["prefill_speedup_vs_bf16"] = r["prefill_tokens_per_s"] / base["prefill_tokens_per_s"]
            r["first_ids_agree_with_bf16"] = sum(
                a == b for a, b in zip(r["first_ids"], base["first_ids"])) / len(base["first_ids"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "decode_step_smoke" if args.smoke else "decode_step"
    meta = {"model": "tiny (smoke)" if args.smoke else "Llama-3-8B shape, random weights (dummy)",
            "device": next((r["device"] for r in rows if "device" in r), "?")}
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "results": rows}, indent=1))
    (out / f"{stem}.md").write_text(markdown(meta, rows))
    print(markdown(meta, rows))
    ok = all(not r.get("failed") and r["ids_in_vocab"] for r in rows)
    return 0 if ok else 1


def markdown(meta, rows) -> str:
    target = {"rtn-int4": ("decode", 3.0), "rtn-int4-head8": ("decode", 3.0),
              "int8": ("decode", 1.7), "int8-head8": ("decode", 1.7), "w8a8": ("prefill", 1.5),
              "fp8": ("prefill", 1.5)}
    lines = [f"# Engine decode (batch 1) and prefill by weight format ({meta['device']}, "
             f"{meta['model']})", "",
             "Through `LLM(..., load_format=\"dummy\", quantization=...)`: scheduler, sampler and "
             "CUDA graphs included. Decode: 128-token prompt, 128 greedy tokens, batch 1; "
             "prefill: one 2048-token prompt (smoke: smaller). Medians of the timed runs.", "",
             "| scheme | decode tok/s | x bf16 | prefill tok/s | x bf16 | first 32 ids = bf16 | "
             "target |", "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        if r.get("failed"):
            lines.append(f"| {r['scheme']} | failed | | | | | |")
            continue
        t = target.get(r["scheme"].split(":")[0])
        tgt = ""
        if t and "decode_speedup_vs_bf16" in r:
            got = r[f"{t[0]}_speedup_vs_bf16"]
            tgt = f"{t[0]} >= {t[1]}x: {'met' if got >= t[1] else 'not met'}"
        lines.append(f"| {r['scheme']} | {r['decode_tokens_per_s']:.1f} | "
                     f"{r.get('decode_speedup_vs_bf16', float('nan')):.2f} | "
                     f"{r['prefill_tokens_per_s']:.0f} | "
                     f"{r.get('prefill_speedup_vs_bf16', float('nan')):.2f} | "
                     f"{r.get('first_ids_agree_with_bf16', float('nan')):.2f} | {tgt} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())

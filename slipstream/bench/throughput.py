"""`slipstream bench throughput`: many requests at once through `LLM.generate`
(vLLM's benchmark_throughput).

`--num-prompts` requests, ShareGPT-like lengths (`--dataset sharegpt-like`,
see dataset.py) or fixed `--input-len`/`--output-len` (`--dataset random`),
all from `--dataset-seed`, are submitted together with `ignore_eos`, so each
generates exactly its drawn length. Reports requests/s, output tokens/s and
total (prompt + output) tokens/s over the wall time of the whole run, and the
analysis layer's bound for the steps the scheduler actually ran: each step's
least time on this device (its bytes at the copy bandwidth, or its FLOPs at the
matmul rate, both measured in the same run), summed, against the measured time.
"""
from __future__ import annotations

import time
from collections import Counter


def add_arguments(p) -> None:
    from slipstream.bench.dataset import DATASETS
    from slipstream.commands.options import number
    p.add_argument("--num-prompts", type=number(int, 1), default=1000, help="requests in the run")
    p.add_argument("--dataset", choices=DATASETS, default=None,
                   help="sharegpt-like (default) or random (needs --input-len and --output-len)")
    p.add_argument("--input-len", type=int, default=None,
                   help="prompt tokens per request (with --output-len: fixed lengths)")
    p.add_argument("--output-len", type=int, default=None, help="generated tokens per request")


def make_requests(args, vocab_size: int, max_model_len: int):
    from slipstream.bench.dataset import fixed_requests, sharegpt_like_requests
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be at least 1")
    fixed = args.input_len is not None or args.output_len is not None
    dataset = args.dataset or ("random" if fixed else "sharegpt-like")
    if dataset == "random":
        if args.input_len is None and args.output_len is None:
            raise ValueError("--dataset random needs --input-len and --output-len")
        if args.input_len is None or args.output_len is None:
            given, missing = (("--input-len", "--output-len") if args.input_len is not None
                              else ("--output-len", "--input-len"))
            raise ValueError(f"{given} needs {missing} too (the random dataset's lengths; "
                             "without both, the default dataset sets them per request)")
        return dataset, fixed_requests(args.num_prompts, args.input_len, args.output_len,
                                       vocab_size, max_model_len, args.dataset_seed)
    if fixed:
        raise ValueError("--input-len/--output-len fix the lengths: use them without "
                         "--dataset sharegpt-like")
    return dataset, sharegpt_like_requests(args.num_prompts, vocab_size, max_model_len,
                                           args.dataset_seed)


def run(llm, args, hardware) -> dict:
    """hardware: a HardwareProfile measured on this device (None: no bound)."""
    from slipstream.analysis.model_spec import ModelSpec
    from slipstream.bench.step_bound import precisions_for, step_time_bound
    from slipstream.sampling_params import SamplingParams

    engine = llm.engine
    cfg = engine.config
    dataset, reqs = make_requests(args, cfg.model_config.vocab_size, engine.max_model_len)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
    params = [SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True)
              for r in reqs]
    engine.step_stats = []
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    steps, engine.step_stats = engine.step_stats, None

    n_in = sum(len(r.prompt_token_ids) for r in reqs)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    res = {
        "dataset": dataset, "num_prompts": len(reqs), "dataset_seed": args.dataset_seed,
        "prompt_tokens": n_in, "output_tokens": n_out, "elapsed_s": elapsed,
        "requests_per_s": len(reqs) / elapsed, "output_tokens_per_s": n_out / elapsed,
        "total_tokens_per_s": (n_in + n_out) / elapsed, "num_steps": len(steps),
        "batch_sizes": _batch_summary(steps),
    }
    spec = ModelSpec.from_model_config(cfg.model_config)
    prec = precisions_for(cfg.dtype, cfg.quantization, cfg.cache.kv_cache_dtype, spec.head_dim,
                          getattr(engine.runner, "model", None))
    if hardware is not None and steps and prec is not None:
        bound_s = sum(step_time_bound(spec, hardware, s, prec) for s in steps)
        res["roofline"] = {
            "hardware": hardware.name, "source": hardware.source,
            "memory_bandwidth_GBps": hardware.memory_bandwidth / 1e9,
            "matmul_TFLOPs": hardware.bf16_flops / 1e12,
            "bound_s": bound_s, "bound_output_tokens_per_s": n_out / bound_s,
            "bound_requests_per_s": len(reqs) / bound_s,
            "pct_of_bound": 100 * bound_s / elapsed,
        }
    return res


def _batch_summary(steps) -> dict:
    """How many requests the steps ran: decode-only steps and mixed ones apart."""
    decode = [s.num_seqs for s in steps if s.num_decode_seqs == s.num_seqs]
    mixed = [s for s in steps if s.num_decode_seqs < s.num_seqs]
    hist = Counter(decode)
    return {
        "decode_steps": len(decode), "mixed_steps": len(mixed),
        "decode_batch_mean": sum(decode) / len(decode) if decode else None,
        "decode_batch_max": max(decode) if decode else None,
        "mixed_tokens_mean": sum(s.num_tokens for s in mixed) / len(mixed) if mixed else None,
        "decode_batch_histogram": {str(k): hist[k] for k in sorted(hist)},
    }


def report(res: dict) -> str:
    b = res["batch_sizes"]
    lines = [f"{res['num_prompts']} requests ({res['dataset']}, seed {res['dataset_seed']}): "
             f"{res['prompt_tokens']} prompt + {res['output_tokens']} output tokens in "
             f"{res['elapsed_s']:.2f} s",
             f"  throughput: {res['requests_per_s']:.2f} requests/s, "
             f"{res['output_tokens_per_s']:.1f} output tokens/s, "
             f"{res['total_tokens_per_s']:.1f} total tokens/s",
             f"  steps: {res['num_steps']} ({b['decode_steps']} decode-only, mean batch "
             f"{_f(b['decode_batch_mean'])}, max {b['decode_batch_max']}; {b['mixed_steps']} "
             f"with prompt tokens)"]
    r = res.get("roofline")
    if r:
        lines.append(f"  roofline bound for these steps ({r['hardware']}, "
                     f"{r['memory_bandwidth_GBps']:.0f} GB/s, {r['matmul_TFLOPs'] * 1e3:.0f} GFLOP/s "
                     f"measured): {r['bound_s']:.2f} s = {r['bound_output_tokens_per_s']:.1f} "
                     f"output tokens/s; achieved {r['pct_of_bound']:.0f}% of it")
    return "\n".join(lines)


def _f(x) -> str:
    return "-" if x is None else f"{x:.1f}"

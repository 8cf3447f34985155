"""`slipstream bench latency`: one batch of random token-id prompts, prefill
and decode timed separately (vLLM's benchmark_latency, with the step split).

Each iteration runs `--batch-size` new prompts of `--input-len` random token
ids (seeded by `--dataset-seed` and the iteration, so none hits the prefix
cache) with `max_tokens=--output-len` and `ignore_eos` to the end, then another
batch of fresh prompts of the same lengths to its first token only: that is
the prefill time. The decode step time is the first run's time from the step
that returned the last of its first tokens to its end, over output_len - 1 (one
run's own clock: the difference of two runs' times can come out negative when
one of them meets a hiccup). Timing runs rather than single steps holds when
the engine overlaps a step's host work with the previous step's device work. After
`--num-iters-warmup` untimed iterations, `--num-iters` timed ones give the
medians of: latency, prefill time, decode step time and decode tokens/s
(batch / step time). On a GPU the decode step is also set against the
device's copy bandwidth measured in the same run: the bytes a decode step must
move (weights + KV cache read + activations, from `slipstream.analysis` at the
mean decode context) over the step time, as a share of that bandwidth.
"""
from __future__ import annotations

import statistics
import time


def add_arguments(p) -> None:
    p.add_argument("--batch-size", type=int, default=8, help="prompts in the batch")
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=128, help="generated tokens per request")
    p.add_argument("--num-iters-warmup", type=int, default=1, help="untimed iterations first")
    p.add_argument("--num-iters", type=int, default=3, help="timed iterations")


def validate(args) -> None:
    for name in ("batch_size", "input_len", "output_len", "num_iters"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    if args.num_iters_warmup < 0:
        raise ValueError("--num-iters-warmup must be at least 0")


def _time_batch(engine, prompts, params) -> tuple[float, float]:
    """Seconds from the first step to the end of the batch, and to the step that
    returned the last of its requests' first tokens."""
    waiting = {engine.add_request({"prompt_token_ids": p}, params) for p in prompts}
    t0 = time.perf_counter()
    first = None
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if waiting:
            waiting.difference_update(o.request_id for o in outputs
                                      if o.outputs and o.outputs[0].token_ids)
            if not waiting:
                first = time.perf_counter() - t0
    total = time.perf_counter() - t0
    return total, total if first is None else first


def _one_iteration(engine, prompts, params, prompts_again) -> dict:
    """The batch run whole, then (fresh prompts of the same lengths, so no
    prefix-cache hit) run to its first token only: the prefill. The decode step
    time is the whole run's time after its first tokens over the remaining
    tokens; unlike timing single steps, this holds when the engine overlaps steps."""
    import dataclasses
    total, first = _time_batch(engine, prompts, params)
    prefill, _ = _time_batch(engine, prompts_again, dataclasses.replace(params, max_tokens=1))
    decode = (total - first) / (params.max_tokens - 1) if params.max_tokens > 1 else None
    return {"total_s": total, "prefill_s": prefill, "decode_step_s": decode}


def run(engine, args, copy_bandwidth: float | None) -> dict:
    """Returns the results dict (also printed by the caller)."""
    from slipstream.analysis.model_spec import ModelSpec
    from slipstream.bench.dataset import fixed_requests
    from slipstream.bench.step_bound import precisions_for, step_bytes
    from slipstream.engine.stats import StepStats
    from slipstream.sampling_params import SamplingParams

    validate(args)
    cfg = engine.config

    def prompts(i: int) -> list[list[int]]:
        # New prompts every iteration, so no iteration hits the prefix cache of another.
        reqs = fixed_requests(args.batch_size, args.input_len, args.output_len,
                              cfg.model_config.vocab_size, engine.max_model_len,
                              args.dataset_seed * 1000 + i)
        return [r.prompt_token_ids for r in reqs]

    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    warm = args.num_iters_warmup
    for i in range(warm):
        _one_iteration(engine, prompts(2 * i), params, prompts(2 * i + 1))
    iters = [_one_iteration(engine, prompts(2 * (warm + i)), params, prompts(2 * (warm + i) + 1))
             for i in range(args.num_iters)]

    med = lambda key: statistics.median(it[key] for it in iters)  # noqa: E731
    total, prefill = med("total_s"), med("prefill_s")
    decode_steps = [it["decode_step_s"] for it in iters if it["decode_step_s"] is not None]
    step = statistics.median(decode_steps) if decode_steps else None
    b = args.batch_size
    res = {
        "batch_size": b, "input_len": args.input_len, "output_len": args.output_len,
        "num_iters": args.num_iters, "latency_s": total,
        "latency_per_iter_s": [it["total_s"] for it in iters],
        "prefill_s": prefill, "prefill_tokens_per_s": b * args.input_len / prefill if prefill else None,
        "decode_step_s": step, "decode_tokens_per_s": b / step if step else None,
        "output_tokens_per_s": b * args.output_len / total,
        "copy_bandwidth_GBps": copy_bandwidth / 1e9 if copy_bandwidth else None,
        "decode_step_bytes": None, "decode_pct_copy_bandwidth": None,
    }
    spec = ModelSpec.from_model_config(cfg.model_config)
    prec = precisions_for(cfg.dtype, cfg.quantization, cfg.cache.kv_cache_dtype, spec.head_dim,
                          getattr(engine.runner, "model", None))
    if step and prec is not None:     # None: a weight or cache format the analysis does not model
        mean_ctx = args.input_len + args.output_len // 2
        nbytes = step_bytes(spec, StepStats(b, b, b, b * mean_ctx), prec)
        res["decode_step_bytes"] = nbytes
        if copy_bandwidth:
            res["decode_pct_copy_bandwidth"] = 100 * nbytes / step / copy_bandwidth
    return res


def report(res: dict) -> str:
    lines = [f"batch {res['batch_size']}, input {res['input_len']}, output {res['output_len']} "
             f"tokens, {res['num_iters']} timed iterations (medians)",
             f"  latency:  {res['latency_s']:.3f} s per batch, "
             f"{res['output_tokens_per_s']:.1f} output tokens/s end to end",
             f"  prefill:  {res['prefill_s'] * 1e3:.1f} ms "
             f"({_f(res['prefill_tokens_per_s'])} prompt tokens/s)"]
    if res["decode_step_s"]:
        line = (f"  decode:   {res['decode_step_s'] * 1e3:.2f} ms per step, "
                f"{res['decode_tokens_per_s']:.1f} tokens/s")
        if res["decode_pct_copy_bandwidth"] is not None:
            line += (f", {res['decode_pct_copy_bandwidth']:.0f}% of the copy bandwidth "
                     f"({res['decode_step_bytes'] / 1e9:.2f} GB per step at "
                     f"{res['copy_bandwidth_GBps']:.0f} GB/s)")
        lines.append(line)
    return "\n".join(lines)


def _f(x) -> str:
    return "-" if x is None else f"{x:.1f}"

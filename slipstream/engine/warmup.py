"""CUDA graphs captured before serving, instead of on their first use.

The runner captures a graph the first time a step needs it: a token bucket's
pieces around attention (runner/piecewise.py) when a step with prompt tokens
first falls in that bucket, a batch-size bucket's decode graph when a decode
step first has that many requests (runner/cuda_graph.py). Each capture stalls
that step (an eager run, then the capture: ~0.1 s for an 8B model), and a
fresh server meets them one by one in its first minutes. `capture_graphs`
meets them at start-up: one prompt a token bucket (its tokens computed in one
step), then for each batch-size bucket that many one-token prompts decoding
one step together, which also captures the bucket's graphs for the longer
context classes (other split counts; DecodeGraphs.capture_every_class).

Prompts are random token ids through the engine's own step loop; their cache
blocks are freed and the prefix cache reset afterwards, so nothing of them
stays. Not with speculative decoding (its rounds verify drafts with graphs of
their own) or tensor parallelism (the runner there has no local graphs).
"""
from __future__ import annotations

import random
import time

from slipstream.sampling_params import SamplingParams


def capture_graphs(engine, log=None) -> dict:
    """Capture the engine's CUDA graphs ahead of serving; returns what was
    captured and the seconds it took ({"skipped": reason} when there is
    nothing to capture). `log`: a callable taking one line of progress."""
    runner = getattr(engine, "runner", None)     # a prefill/decode pair has none
    graphs, pieces = getattr(runner, "graphs", None), getattr(runner, "piecewise", None)
    if graphs is None:
        return {"skipped": "no CUDA graphs (CPU, --enforce-eager or tensor parallelism)"}
    if getattr(runner, "speculator", None) is not None:
        return {"skipped": "speculative decoding captures its verification graphs as it goes"}
    if engine.has_unfinished_requests():
        raise RuntimeError("capture_graphs: the engine is already running requests")
    t0 = time.perf_counter()
    rng = random.Random(0)
    vocab = engine.config.model_config.vocab_size
    greedy = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    budget = engine.config.scheduler.max_num_batched_tokens
    token_buckets = []
    if pieces is not None and pieces.enabled and pieces.mode == "graphs":
        longest = min(budget, engine.max_model_len - 1)
        token_buckets = [t for t in pieces.buckets if t <= longest]
    # Largest first: the smaller captures reuse the memory the larger left in the pool.
    for i, t in enumerate(sorted(token_buckets, reverse=True)):
        _run(engine, [[rng.randrange(vocab) for _ in range(t)]], greedy)
        if log is not None and (i + 1) % 8 == 0:
            log(f"captured {i + 1} of {len(token_buckets)} prompt-token buckets")
    max_seqs = engine.config.scheduler.max_num_seqs
    seq_buckets = [b for b in graphs.buckets if b <= max_seqs]
    two = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    graphs.capture_every_class = True
    try:
        for b in sorted(seq_buckets, reverse=True):
            _run(engine, [[rng.randrange(vocab)] for _ in range(b)], two)
    finally:
        graphs.capture_every_class = False
    engine.reset_prefix_cache()
    seconds = time.perf_counter() - t0
    if log is not None:
        log(f"captured CUDA graphs for {len(token_buckets)} prompt-token buckets and "
            f"{len(seq_buckets)} decode batch sizes ({len(graphs.graphs)} decode graphs) "
            f"in {seconds:.1f} s")
    return {"token_buckets": len(token_buckets), "decode_buckets": len(seq_buckets),
            "decode_graphs": len(graphs.graphs), "seconds": seconds}


def _run(engine, prompts: list[list[int]], params: SamplingParams) -> None:
    for ids in prompts:
        engine.add_request({"prompt_token_ids": ids}, params)
    while engine.has_unfinished_requests():
        engine.step()

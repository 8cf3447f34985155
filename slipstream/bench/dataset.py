"""Benchmark requests: random token-id prompts with fixed or ShareGPT-like lengths.

"sharegpt-like" draws prompt and output lengths from log-normal laws shaped
like ShareGPT conversations (the same laws as `slipstream bench serve`:
median prompt 150 tokens, sigma 1.0; median output 120, sigma 0.9), clipped
to prompts of 50..1500 and outputs of 20..800 tokens, and then to the
context limit. Token ids come from the middle 80% of the vocabulary (away
from special tokens). Everything is drawn from one seed: the same
`--dataset-seed` gives the same requests.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

DATASETS = ("random", "sharegpt-like")
PROMPT_MEDIAN, PROMPT_SIGMA, PROMPT_RANGE = 150.0, 1.0, (50, 1500)
OUTPUT_MEDIAN, OUTPUT_SIGMA, OUTPUT_RANGE = 120.0, 0.9, (20, 800)


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def _ids(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    lo, hi = max(0, vocab_size // 10), max(1, vocab_size * 9 // 10)
    return [rng.randrange(lo, hi) for _ in range(n)]


def _fit(prompt: int, output: int, max_model_len: int) -> tuple[int, int]:
    """Clip so that prompt + output fits the context (prompt at most half of it)."""
    prompt = max(1, min(prompt, max_model_len // 2))
    return prompt, max(1, min(output, max_model_len - prompt))


def fixed_requests(num: int, input_len: int, output_len: int, vocab_size: int,
                   max_model_len: int, seed: int = 0) -> list[BenchRequest]:
    if input_len < 1 or output_len < 1:
        raise ValueError("input_len and output_len must be at least 1")
    if input_len + output_len > max_model_len:
        raise ValueError(f"input_len + output_len = {input_len + output_len} exceeds the "
                         f"maximum model length {max_model_len}")
    rng = random.Random(seed)
    return [BenchRequest(_ids(rng, input_len, vocab_size), output_len) for _ in range(num)]


def sharegpt_like_requests(num: int, vocab_size: int, max_model_len: int,
                           seed: int = 0) -> list[BenchRequest]:
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        p = round(rng.lognormvariate(math.log(PROMPT_MEDIAN), PROMPT_SIGMA))
        o = round(rng.lognormvariate(math.log(OUTPUT_MEDIAN), OUTPUT_SIGMA))
        p = min(max(p, PROMPT_RANGE[0]), PROMPT_RANGE[1])
        o = min(max(o, OUTPUT_RANGE[0]), OUTPUT_RANGE[1])
        p, o = _fit(p, o, max_model_len)
        out.append(BenchRequest(_ids(rng, p, vocab_size), o))
    return out

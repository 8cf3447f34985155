"""Perplexity of a model on a text, through the engine (`LLM.generate` with prompt_logprobs).

Sliding window: the tokens are cut into windows of `context` tokens starting every
`stride` tokens; the first window scores all its tokens after the first, each later
window scores only its last `stride` tokens (the ones no earlier window scored), each
conditioned on up to context - 1 tokens before it. stride == context gives disjoint
windows (every window's first token then goes unscored, except where a previous
window covered it). ppl = exp(mean negative log-likelihood of the scored tokens).
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class PerplexityResult:
    ppl: float
    nll: float            # mean negative log-likelihood (nats per token)
    tokens: int           # tokens scored
    windows: int
    context: int
    stride: int


def check_windows(context: int, stride: int | None, names=("context", "stride")) -> None:
    """Raise ValueError for windows that cannot score (stride None: the default),
    naming the options as the caller spells them (the command line: --context)."""
    c, st = names
    if context < 2:
        raise ValueError(f"{c}: expected at least 2 tokens, got {context}")
    if stride is not None and not 1 <= stride <= context:
        raise ValueError(f"{st}: expected 1..{c} ({context}), got {stride}")


def sliding_windows(n: int, context: int, stride: int) -> list[tuple[int, int, int]]:
    """(start, end, first scored index) of each window over n tokens."""
    check_windows(context, stride)
    out, scored_upto = [], 1          # token 0 has no context: never scored
    start = 0
    while scored_upto < n:
        end = min(start + context, n)
        first = max(scored_upto, start + 1)
        out.append((start, end, first))
        scored_upto = end
        start += stride
        if end == n:
            break
    return out


def perplexity(llm, token_ids: list[int], context: int = 1024,
               stride: int | None = None, batch: int = 8) -> PerplexityResult:
    from slipstream.sampling_params import SamplingParams
    stride = context // 2 if stride is None else stride
    wins = sliding_windows(len(token_ids), context, stride)
    sp = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
    nll, n = 0.0, 0
    for i in range(0, len(wins), batch):
        chunk = wins[i:i + batch]
        outs = llm.generate([{"prompt_token_ids": token_ids[s:e]} for s, e, _ in chunk], sp,
                            use_tqdm=False)
        for (s, e, first), o in zip(chunk, outs):
            for j in range(first, e):
                nll -= o.prompt_logprobs[j - s][token_ids[j]].logprob
                n += 1
    return PerplexityResult(math.exp(nll / n), nll / n, n, len(wins), context, stride)

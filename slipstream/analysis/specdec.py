"""Speculative decoding in theory (reference chapter, sections 3.3-3.4).

alpha: probability that the target accepts a draft token (independent per
position); gamma: draft tokens per round; c: draft step time / target step time.
"""
from __future__ import annotations

import numpy as np


def _check(alpha: float, gamma: int, c: float = 0.0) -> None:
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must lie in [0, 1], got {alpha}")
    if gamma < 0 or int(gamma) != gamma:
        raise ValueError(f"gamma must be a non-negative integer, got {gamma}")
    if c < 0:
        raise ValueError(f"c must be >= 0, got {c}")


def expected_tokens(alpha: float, gamma: int) -> float:
    """tau = (1 - alpha^(gamma+1)) / (1 - alpha): tokens per verification round,
    the bonus or resampled token included (gamma + 1 when alpha = 1)."""
    _check(alpha, gamma)
    if alpha == 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def speedup(alpha: float, gamma: int, c: float) -> float:
    """S = tau / (gamma c + 1): a round costs gamma draft steps and one target
    step, which verifies all gamma + 1 positions in the time of one (decode is
    memory-bound: the extra positions ride on the same weight reads)."""
    _check(alpha, gamma, c)
    return expected_tokens(alpha, gamma) / (gamma * c + 1.0)


def best_gamma(alpha: float, c: float, max_gamma: int = 64) -> int:
    """Draft length with the highest speedup (the shortest among ties). With
    c = 0 speedup grows with gamma forever, so max_gamma bounds the search."""
    gammas = range(1, max_gamma + 1)
    speeds = [speedup(alpha, g, c) for g in gammas]
    best = max(speeds)
    return next(g for g, s in zip(gammas, speeds) if s >= best * (1 - 1e-12))


def max_speedup(alpha: float) -> float:
    """1 / (1 - alpha): the limit of S for a free draft (c -> 0) and gamma -> inf."""
    _check(alpha, 0)
    return float("inf") if alpha == 1.0 else 1.0 / (1.0 - alpha)


def acceptance_rate(p, q) -> float:
    """alpha = sum_x min(p(x), q(x)) = 1 - TVD(p, q) for target p and draft q."""
    p, q = np.asarray(p, dtype=np.float64), np.asarray(q, dtype=np.float64)
    if p.shape != q.shape or p.ndim != 1:
        raise ValueError(f"p and q must be 1-D and of one shape, got {p.shape} and {q.shape}")
    for name, dist in (("p", p), ("q", q)):
        if (dist < 0).any() or abs(dist.sum() - 1.0) > 1e-6:
            raise ValueError(f"{name} is not a probability distribution (sum {dist.sum():.6g})")
    return float(np.minimum(p, q).sum())


def total_variation(p, q) -> float:
    return 1.0 - acceptance_rate(p, q)


def speedup_at_batch(alpha: float, gamma: int, c: float, batch: float,
                     critical_batch: float) -> float:
    """Speedup once batching is counted, on a roofline where a target step
    over n tokens costs max(1, n / critical_batch) memory-bound step times.

    Plain decode of `batch` sequences costs max(1, B / Bc); a round drafts
    gamma tokens (the small draft stays memory-bound: gamma c) and verifies
    B (gamma + 1) tokens: max(1, B (gamma + 1) / Bc). Past Bc / (gamma + 1) the
    verification is compute-bound and the extra positions stop being free."""
    _check(alpha, gamma, c)
    plain = max(1.0, batch / critical_batch)
    spec = gamma * c + max(1.0, batch * (gamma + 1) / critical_batch)
    return expected_tokens(alpha, gamma) * plain / spec


def breakeven_batch(alpha: float, gamma: int, c: float, critical_batch: float) -> float:
    """Batch above which speculation is slower than plain decoding.

    Solving speedup_at_batch = 1: between Bc / (gamma + 1) and Bc the speedup is
    tau / (gamma c + B (gamma + 1) / Bc), which is 1 at B = Bc (tau - gamma c) /
    (gamma + 1); above Bc it stays below tau / (gamma + 1) <= 1. Returns 0 when
    speculation does not pay even at batch 1 (tau <= gamma c + 1)."""
    tau = expected_tokens(alpha, gamma)
    _check(alpha, gamma, c)
    if tau <= gamma * c + 1.0:
        return 0.0
    return critical_batch * (tau - gamma * c) / (gamma + 1)


def alpha_from_tau(tau: float, gamma: int) -> float:
    """Invert expected_tokens: the per-position acceptance alpha that gives
    `tau` tokens per round with gamma drafts (a measured tau in, alpha out)."""
    _check(0.0, gamma)
    if not 1.0 <= tau <= gamma + 1.0:
        raise ValueError(f"tau must lie in [1, gamma + 1 = {gamma + 1}], got {tau}")
    lo, hi = 0.0, 1.0
    for _ in range(60):  # expected_tokens grows with alpha
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, gamma) < tau else (lo, mid)
    return (lo + hi) / 2


def round_speedup(tau: float, verify_tokens: float, draft_cost: float, batch: float,
                  critical_batch: float) -> float:
    """Measured form of speedup_at_batch, for any draft shape (chain or tree):
    a round emits `tau` tokens per request and costs `draft_cost` (draft time
    in units of one plain decode step at batch 1) plus a target step over
    batch x verify_tokens tokens; plain decode costs max(1, B / Bc) per token."""
    plain = max(1.0, batch / critical_batch)
    spec = draft_cost + max(1.0, batch * verify_tokens / critical_batch)
    return tau * plain / spec


def best_gamma_at_batch(alpha: float, c: float, batch: float, critical_batch: float,
                        max_gamma: int = 16) -> int:
    """The auto-off rule: the chain length with the highest speedup at this
    batch size on the roofline model, or 0 (speculation off) when no length
    beats plain decoding."""
    best, best_s = 0, 1.0
    for g in range(1, max_gamma + 1):
        s = speedup_at_batch(alpha, g, c, batch, critical_batch)
        if s > best_s * (1 + 1e-12):
            best, best_s = g, s
    return best


def critical_batch_for(model_config, hardware, context: int = 1024,
                       weight_bytes_per_param: float = 2.0) -> float:
    """Bc for the roofline rule: the decode batch at which a step of this model
    turns compute-bound on `hardware` (KV reads at `context` counted); when KV
    traffic keeps it memory-bound at any batch, the weight-only bound."""
    from slipstream.analysis.model_spec import ModelSpec
    from slipstream.analysis.roofline import critical_batch_size, weights_critical_batch
    spec = ModelSpec.from_model_config(model_config)
    bc = critical_batch_size(spec, hardware, context)
    return float(bc) if bc is not None else weights_critical_batch(hardware, weight_bytes_per_param)

"""Token sampling with vLLM (v1) semantics.

Order of operations in `Sampler.forward` (each step skipped when no row uses it):
  1. logprobs of the raw model logits, if any row asked for them ("raw_logprobs");
  2. min_tokens: stop tokens and EOS get -inf until a row has min_tokens outputs;
     logit_bias: the requested values are added to those tokens' logits;
  3. penalties: repetition over prompt + output tokens (positive logits divided,
     negative multiplied), then frequency and presence over output tokens
     (subtracted);
  4. greedy rows: argmax. Random rows: temperature, min-p, then top-k and top-p
     (vLLM applies min-p before top-k/top-p; it only matters when min-p and top-p
     are combined, since top-p then sees the min-p-renormalised distribution),
     then one draw by the exponential race argmax(probs / Exp(1)).

No host-device sync happens inside `forward` on a GPU: every decision that
depends on the batch's contents is taken on the host by `SamplingBatch.build`,
and the exponential race needs no inverse-CDF search or `.item()`. On a CPU,
where values are on the host anyway, top-p first looks among the likeliest
tokens only (`nucleus_candidates`), instead of sorting the vocabulary. Seeded rows draw
their noise from their own `torch.Generator`, so a seed reproduces the same
tokens whatever else shares the batch.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from slipstream.layers.argmax import row_argmax
# compute_prompt_logprobs is re-exported: the runner takes its sampling API from here.
from slipstream.layers.logprobs import (LogprobsTensors, compute_logprobs,  # noqa: F401
                                        compute_prompt_logprobs, gather_logprobs)
from slipstream.sampling_params import SAMPLING_EPS, SamplingParams

_NEG_INF = float("-inf")


def make_generator(params: SamplingParams, device: torch.device | str) -> torch.Generator | None:
    """The per-request generator for a seeded request (None otherwise). The runner
    creates it once per sequence and passes the same object every step, so its
    state advances with the sequence."""
    if params.seed is None:
        return None
    return torch.Generator(device=device).manual_seed(params.seed)


def _padded(rows: Sequence[Sequence[int]], pad: int, device) -> torch.Tensor:
    """[len(rows), max(1, longest)] int64, padded with `pad` (an id past the vocab).
    Filled through numpy: about 4x faster than building padded Python lists."""
    width = max(1, max((len(r) for r in rows), default=0))
    table = np.full((len(rows), width), pad, dtype=np.int64)
    for i, r in enumerate(rows):
        table[i, :len(r)] = r
    return torch.from_numpy(table).to(device)


@dataclass
class Penalties:
    repetition: torch.Tensor         # [num_rows] float32, 1.0 = off
    frequency: torch.Tensor          # [num_rows] float32, 0.0 = off
    presence: torch.Tensor           # [num_rows] float32, 0.0 = off
    output_counts: torch.Tensor      # [num_rows, vocab] int32, occurrences in the output so far
    prompt_mask: torch.Tensor        # [num_rows, vocab] bool, tokens of the prompt


@dataclass
class SamplingBatch:
    """Per-step sampling inputs, one row per request that samples this step.

    Optional tensors are None when no row uses the feature, so a plain batch
    (say, all greedy or all temperature-only) costs one argmax or one softmax.
    """
    num_rows: int
    all_greedy: bool
    all_random: bool
    temperature: torch.Tensor | None   # [num_rows] float32; None when all greedy
    top_k: torch.Tensor | None         # [num_rows] int64 in [1, vocab]; vocab = off
    max_top_k: int                     # host copy of the largest enabled top_k
    top_p: torch.Tensor | None         # [num_rows] float32 in (0, 1]
    min_p: torch.Tensor | None         # [num_rows] float32 in [0, 1]
    generators: dict[int, torch.Generator]  # row -> generator, seeded random rows only
    penalties: Penalties | None
    # (rows, token ids) set to -inf for rows still short of min_tokens.
    min_tokens_mask: tuple[torch.Tensor, torch.Tensor] | None
    max_num_logprobs: int | None       # k of the widest logprobs request; None: none asked
    rows: torch.Tensor | None = None   # [num_rows] int64, the rows' persistent slots (runner)
    # (rows, token ids, values) added to the logits (logit_bias), or None.
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def build(cls, params: list[SamplingParams], prompt_token_ids: list[list[int]],
              output_token_ids: list[list[int]],
              generators: list[torch.Generator | None], vocab_size: int,
              device: torch.device | str,
              eos_token_ids: Sequence[int] = ()) -> SamplingBatch:
        """Assembly from whole token histories (the reference the runner's
        incremental `runner.sampling_state` is tested against). `generators[i]`
        is row i's `make_generator` result; `eos_token_ids` are masked with each
        row's stop_token_ids under min_tokens."""
        n = len(params)
        assert len(prompt_token_ids) == len(output_token_ids) == len(generators) == n

        def f32(values):
            return torch.tensor(values, dtype=torch.float32, device=device)

        greedy = [p.is_greedy for p in params]
        all_greedy, all_random = all(greedy), not any(greedy)
        ks = [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params]
        use_top_k = any(k < vocab_size for k in ks)
        use_top_p = any(p.top_p < 1.0 for p in params)
        use_min_p = any(p.min_p > 0.0 for p in params)

        penalties = None
        if any(p.has_penalties for p in params):
            penalties = Penalties(
                repetition=f32([p.repetition_penalty for p in params]),
                frequency=f32([p.frequency_penalty for p in params]),
                presence=f32([p.presence_penalty for p in params]),
                output_counts=_bin_counts(_padded(output_token_ids, vocab_size, device),
                                          vocab_size).to(torch.int32),
                prompt_mask=_bin_counts(_padded(prompt_token_ids, vocab_size, device),
                                        vocab_size) > 0,
            )

        mask_rows, mask_ids = [], []
        for row, (p, out) in enumerate(zip(params, output_token_ids)):
            if len(out) < p.min_tokens:
                stops = dict.fromkeys([*p.stop_token_ids, *eos_token_ids])
                ids = [t for t in stops if t < vocab_size]
                mask_rows += [row] * len(ids)
                mask_ids += ids
        min_tokens_mask = None
        if mask_rows:
            min_tokens_mask = (torch.tensor(mask_rows, dtype=torch.int64, device=device),
                               torch.tensor(mask_ids, dtype=torch.int64, device=device))

        widths = [vocab_size if p.logprobs == -1 else min(p.logprobs, vocab_size)
                  for p in params if p.logprobs is not None]
        bias = [(row, t, v) for row, p in enumerate(params) for t, v in (p.logit_bias or {}).items()
                if t < vocab_size]
        logit_bias = None
        if bias:
            r, t, v = zip(*bias)
            logit_bias = (torch.tensor(r, dtype=torch.int64, device=device),
                          torch.tensor(t, dtype=torch.int64, device=device), f32(v))

        return cls(
            num_rows=n,
            all_greedy=all_greedy,
            all_random=all_random,
            temperature=None if all_greedy else f32([p.temperature for p in params]),
            top_k=torch.tensor(ks, dtype=torch.int64, device=device) if use_top_k else None,
            max_top_k=max((k for k in ks if k < vocab_size), default=vocab_size),
            top_p=f32([p.top_p for p in params]) if use_top_p else None,
            min_p=f32([p.min_p for p in params]) if use_min_p else None,
            generators={row: g for row, g in enumerate(generators)
                        if g is not None and not greedy[row]},
            penalties=penalties,
            min_tokens_mask=min_tokens_mask,
            max_num_logprobs=max(widths) if widths else None,
            logit_bias=logit_bias,
        )


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor      # [num_rows] int64
    logprobs: LogprobsTensors | None     # k = batch.max_num_logprobs


def _bin_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    # token_ids: [num_rows, L] padded with vocab_size -> counts [num_rows, vocab_size] float32
    counts = torch.zeros(token_ids.shape[0], vocab_size + 1, dtype=torch.float32,
                         device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids, dtype=torch.float32))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, penalties: Penalties) -> torch.Tensor:
    """logits: [num_rows, vocab] float32 -> a new penalised tensor (vLLM's rules)."""
    output_counts = penalties.output_counts.float()
    output_seen = output_counts > 0
    seen = output_seen | penalties.prompt_mask
    scale = torch.where(seen, penalties.repetition.unsqueeze(1), 1.0)
    # Repetition pushes a seen token's logit towards "less likely" whatever its sign.
    logits = torch.where(logits > 0, logits / scale, logits * scale)
    logits = logits - penalties.frequency.unsqueeze(1) * output_counts
    return logits - penalties.presence.unsqueeze(1) * output_seen


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens less likely than min_p times the row's most likely token."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, _NEG_INF)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, max_top_k: int,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """Keep each row's top_k tokens (ties at the k-th value kept) and then the
    smallest set of most likely tokens whose probability reaches top_p."""
    if top_p is None:
        if top_k is None:
            return logits
        # topk of the widest k is cheaper than a full sort; gather each row's k-th value.
        kth = logits.topk(max_top_k, dim=-1).values.gather(
            1, (top_k.clamp(max=max_top_k) - 1).unsqueeze(1))
        kth = kth.masked_fill((top_k >= logits.shape[1]).unsqueeze(1), _NEG_INF)
        return logits.masked_fill(logits < kth, _NEG_INF)

    ascending, order = logits.sort(dim=-1)
    if top_k is not None:
        # In ascending order the k-th largest sits at column vocab - k (k = vocab: column 0).
        kth = ascending.gather(1, (logits.shape[1] - top_k).unsqueeze(1))
        ascending = ascending.masked_fill(ascending < kth, _NEG_INF)
    # Drop a token when it and every less likely token together hold <= 1 - p;
    # the most likely token always stays.
    cum = ascending.softmax(dim=-1).cumsum(dim=-1)
    drop = cum <= (1.0 - top_p).unsqueeze(1)
    drop[:, -1] = False
    ascending = ascending.masked_fill(drop, _NEG_INF)
    return ascending.scatter(1, order, ascending)


# On a CPU, top-p first looks among this many likeliest tokens (`nucleus_candidates`;
# CPU_NUCLEUS False: the sort of the whole vocabulary, as on a GPU).
NUCLEUS_CANDIDATES = 256
CPU_NUCLEUS = True


# The C kernels' candidates (`ss_row_candidates`): the logits within CANDIDATE_DELTA of
# the row's largest (probability ratio e^-12), or within 8, 5 or 3 where that keeps
# more than CANDIDATE_CAP.
CANDIDATE_DELTA = 12.0
CANDIDATE_CAP = 512


def _c_candidates(logits: torch.Tensor):
    """On a CPU with the C kernels: (vals [rows, w] descending, -inf past a row's
    candidates; their token ids; lse [rows, 1] of the whole row; n [rows] candidates
    held, all of the row's tokens at or above the last one's value; whole [rows]: the
    row had at most CANDIDATE_CAP within the narrowest distance), else None."""
    if logits.is_cuda or logits.dtype != torch.float32:
        return None
    from slipstream.kernels import cpu_library
    lib = cpu_library.load()
    if lib is None:
        return None
    rows, vocab = logits.shape
    x = logits.contiguous()
    cap = min(CANDIDATE_CAP, vocab)
    ids = torch.zeros(rows, cap, dtype=torch.int64)
    lse = torch.empty(rows, dtype=torch.float32)
    count = torch.empty(rows, dtype=torch.int64)
    if lib.ss_row_candidates(x.data_ptr(), rows, vocab, CANDIDATE_DELTA, cap, ids.data_ptr(),
                             lse.data_ptr(), count.data_ptr()) != 0:
        return None
    n = count.clamp(max=cap)
    w = max(1, int(n.max()))
    ids = ids[:, :w]
    held = torch.arange(w) < n[:, None]
    ids = torch.where(held, ids, 0)
    vals, order = x.gather(1, ids).masked_fill(~held, _NEG_INF).sort(dim=-1, descending=True)
    return vals, ids.gather(1, order), lse[:, None], n, count <= cap


def nucleus_candidates(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor,
                       width: int = NUCLEUS_CANDIDATES):
    """top-k / top-p of `apply_top_k_top_p` over each row's likeliest tokens instead
    of a sort of the whole vocabulary: (weights [rows, w], the kept tokens'
    probabilities and 0 elsewhere; their token ids [rows, w]; ok [rows] bool). The
    candidates: with the C kernels, the tokens within CANDIDATE_DELTA (or less) of the
    row's largest logit (`_c_candidates`, a few passes over the row), else the `width`
    likeliest (torch's topk). A row is not ok where it has no top-p (top_p 1) or its
    kept set may reach past the candidates (its top_k is wider, ties at the k-th value
    run past them, they hold less than top_p of its probability, or more than
    CANDIDATE_CAP are within the narrowest distance): the full sort decides those
    rows. Whether a row is ok depends on that row alone, so a seeded row draws the same
    way whatever shares its batch. For CPU tensors (a full sort of a 49k vocabulary
    took ~3 ms a step there, as long as the model's step)."""
    vocab = logits.shape[1]
    ok = top_p < 1.0      # rows without top-p draw over the whole vocabulary, as alone
    c = _c_candidates(logits)
    if c is not None:
        vals, ids, lse, held, whole = c
        ok &= whole
        width = vals.shape[1]
    else:
        width = min(width, vocab)
        vals, ids = logits.topk(width, dim=-1)                      # descending
        lse = logits.logsumexp(-1, keepdim=True)
        held = torch.full((logits.shape[0],), width, dtype=torch.int64)
    if top_k is not None:
        on = top_k < vocab
        kth = vals.gather(1, (top_k.clamp(max=width) - 1).unsqueeze(1))
        ok &= ~(on & (top_k > held))
        if c is None and width < vocab:
            ok &= ~(on & (vals[:, -1] == kth[:, 0]))                # ties may run past
        vals = vals.masked_fill(on.unsqueeze(1) & (vals < kth), _NEG_INF)
        # top-k rows renormalise over their k tokens, the others over the whole row
        lse = torch.where(on.unsqueeze(1), vals.logsumexp(-1, keepdim=True), lse)
    probs = (vals - lse).exp()
    if width < vocab or c is not None:
        ok &= probs.sum(-1) >= top_p
    # A token stays while the more likely ones hold less than top_p (the likeliest always).
    before = probs.cumsum(-1) - probs
    return probs.masked_fill(before >= top_p.unsqueeze(1), 0.0), ids, ok


def row_distribution(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor | None, torch.Tensor]:
    """One sampled row's distribution as `Sampler.sample` forms it (temperature,
    min-p, top-k, top-p): (token ids [n], probabilities [n]) over the tokens it keeps,
    or (None, probabilities [vocab]); the probabilities sum to 1. logits: [1, vocab]
    float32, penalties applied; batch: that row alone, not greedy. On a CPU a top-p
    row whose kept set lies among its likeliest tokens comes from
    `nucleus_candidates`, without a sort of the whole vocabulary."""
    x = logits.float() / batch.temperature.unsqueeze(1)
    if batch.min_p is not None:
        x = apply_min_p(x, batch.min_p)
    if batch.top_p is not None and x.device.type == "cpu" and CPU_NUCLEUS:
        weights, ids, ok = nucleus_candidates(x, batch.top_k, batch.top_p)
        if bool(ok[0]):
            keep = weights[0] > 0
            w = weights[0][keep]
            return ids[0][keep], w / w.sum()
    return None, apply_top_k_top_p(x, batch.top_k, batch.max_top_k, batch.top_p).softmax(dim=-1)[0]


def draw(ids: torch.Tensor | None, probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from `row_distribution`'s (ids, probs) (probs need not sum to 1), by
    the inverse of the cumulative sum at one uniform: a token of probability 0 is
    never drawn. (On a CPU 49k exponential draws, `random_sample`'s way, take ~0.9 ms.)"""
    cum = probs.double().cumsum(0)
    u = float(torch.rand(1, generator=generator, dtype=torch.float64))
    i = int(torch.searchsorted(cum, torch.tensor([u * float(cum[-1])], dtype=torch.float64),
                               right=True)[0])
    if i >= probs.shape[0]:      # rounding at the very top: the last token with mass
        i = int(probs.nonzero()[-1, 0])
    return i if ids is None else int(ids[i])


def _rows(generators: dict[int, torch.Generator], rows: list[int]) -> dict[int, torch.Generator]:
    """The generators of `rows`, keyed by position among them."""
    return {j: generators[r] for j, r in enumerate(rows) if r in generators}


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """probs: [num_rows, vocab] -> [num_rows] int64, one draw per row.

    argmax(p_i / E_i) with E_i ~ Exp(1) picks token i with probability p_i / sum(p)
    (E_i / p_i ~ Exp(p_i); the smallest wins), without a host sync.
    """
    noise = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        noise.exponential_()
    for row, generator in generators.items():
        if generator.device == noise.device:
            noise[row].exponential_(generator=generator)
        else:
            # A generator on another device (a CPU one with CUDA logits): draw there
            # and copy; non_blocking keeps the copy from waiting on the device queue.
            draw = torch.empty(noise.shape[1], dtype=noise.dtype, device=generator.device)
            noise[row].copy_(draw.exponential_(generator=generator), non_blocking=True)
    # A zero draw would turn a masked token's 0 / 0 into NaN, which argmax prefers.
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return row_argmax(probs.div(noise))


class Sampler(nn.Module):
    def forward(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        # logits: [num_rows, vocab]; never modified in place.
        assert logits.shape[0] == batch.num_rows
        logits = logits.float()
        raw_logprobs = None
        if batch.max_num_logprobs is not None:
            raw_logprobs = compute_logprobs(logits)
        if batch.min_tokens_mask is not None:
            logits = logits.index_put(batch.min_tokens_mask, logits.new_full((), _NEG_INF))
        if batch.logit_bias is not None:
            rows, ids, values = batch.logit_bias
            logits = logits.index_put((rows, ids), values, accumulate=True)
        if batch.penalties is not None:
            logits = apply_penalties(logits, batch.penalties)

        sampled = self.sample(logits, batch)
        logprobs = None
        if raw_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, batch.max_num_logprobs, sampled)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    @staticmethod
    def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """logits: [num_rows, vocab] float32, penalties applied -> [num_rows] int64."""
        greedy = None if batch.all_random else row_argmax(logits)
        if batch.all_greedy:
            return greedy
        temperature = batch.temperature
        if not batch.all_random:  # greedy rows divide by 1 and are overwritten below
            temperature = torch.where(temperature < SAMPLING_EPS, 1.0, temperature)
        logits = logits / temperature.unsqueeze(1)
        if batch.min_p is not None:
            logits = apply_min_p(logits, batch.min_p)
        if batch.top_p is not None and logits.device.type == "cpu" and CPU_NUCLEUS:
            sampled = _sample_cpu_nucleus(logits, batch)
        else:
            logits = apply_top_k_top_p(logits, batch.top_k, batch.max_top_k, batch.top_p)
            sampled = random_sample(logits.softmax(dim=-1), batch.generators)
        if greedy is None:
            return sampled
        return torch.where(batch.temperature < SAMPLING_EPS, greedy, sampled)


def _sample_cpu_nucleus(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Top-k / top-p and the draw on a CPU: rows whose kept set lies among their
    likeliest tokens draw among those (the others weigh 0), the rest after the full sort."""
    weights, ids, ok = nucleus_candidates(logits, batch.top_k, batch.top_p)
    fast, slow = ok.nonzero()[:, 0].tolist(), (~ok).nonzero()[:, 0].tolist()
    sampled = torch.empty(logits.shape[0], dtype=torch.int64)
    if fast:
        pick = random_sample(weights[fast], _rows(batch.generators, fast))
        sampled[fast] = ids[fast].gather(1, pick.unsqueeze(1))[:, 0]
    if slow:
        top_k = None if batch.top_k is None else batch.top_k[slow]
        kept = apply_top_k_top_p(logits[slow], top_k, batch.max_top_k, batch.top_p[slow])
        sampled[slow] = random_sample(kept.softmax(dim=-1), _rows(batch.generators, slow))
    return sampled

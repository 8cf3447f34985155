"""Sampler behaviour on random inputs with fixed seeds.

Distribution checks draw N tokens from identical rows and compare each token's
frequency with the analytically filtered distribution: tokens outside the
expected support must never appear, and every frequency must lie within
5 standard errors, 5 * sqrt(p (1 - p) / N), of its probability.
"""
import math

import pytest
import torch

from slipstream.layers.sampler import (Sampler, SamplingBatch, apply_penalties,
                                       make_generator)
from slipstream.sampling_params import SamplingParams

VOCAB = 8
DRAWS = 20_000


def sample(params, logits, prompts=None, outputs=None, generators=None, **kw):
    n = len(params)
    batch = SamplingBatch.build(
        params, prompts or [[] for _ in range(n)], outputs or [[] for _ in range(n)],
        generators or [None] * n, logits.shape[1], "cpu", **kw)
    return Sampler()(logits, batch)


def random_logits(rows, vocab, seed, scale=2.0):
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def reference_probs(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """The distribution a vLLM sampler draws from, written out token by token:
    min-p on softmax(logits / T), then top-k, then top-p on the renormalised rest."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    keep = probs >= min_p * probs.max()
    order = torch.argsort(probs, descending=True).tolist()
    if top_k:
        for rank, token in enumerate(order):
            keep[token] &= rank < top_k
    kept = probs * keep
    kept = kept / kept.sum()
    mass_before = 0.0
    for token in order:  # a token stays while the more likely ones hold < top_p
        if kept[token] > 0:
            keep[token] &= mass_before < top_p
            mass_before += kept[token].item()
    kept = probs * keep
    return kept / kept.sum()


def assert_matches_distribution(tokens, expected):
    counts = torch.bincount(tokens, minlength=expected.numel()).double()
    freq = counts / tokens.numel()
    outside = (expected == 0) & (counts > 0)
    assert not outside.any(), f"sampled outside the support: {outside.nonzero().flatten()}"
    tolerance = 5 * torch.sqrt(expected * (1 - expected) / tokens.numel()) + 1e-12
    assert torch.all((freq - expected).abs() <= tolerance), (freq, expected)


def test_greedy_is_argmax():
    logits = random_logits(16, 50, seed=1)
    out = sample([SamplingParams(temperature=0.0)] * 16, logits)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.sampled_token_ids.dtype == torch.int64 and out.logprobs is None


def test_greedy_rows_stay_argmax_in_a_mixed_batch():
    logits = random_logits(12, 50, seed=2)
    params = [SamplingParams(temperature=0.0) if i % 3 == 0 else
              SamplingParams(temperature=1.5, top_p=0.9, min_p=0.01) for i in range(12)]
    out = sample(params, logits).sampled_token_ids
    assert torch.equal(out[::3], logits[::3].argmax(-1))


@pytest.mark.parametrize("temperature", [0.3, 1.0, 1.9])
def test_top_k_1_and_tiny_top_p_equal_greedy(temperature):
    logits = random_logits(64, 100, seed=3)
    top_k1 = sample([SamplingParams(temperature=temperature, top_k=1)] * 64, logits)
    top_p0 = sample([SamplingParams(temperature=temperature, top_p=1e-6)] * 64, logits)
    assert torch.equal(top_k1.sampled_token_ids, logits.argmax(-1))
    assert torch.equal(top_p0.sampled_token_ids, logits.argmax(-1))


@pytest.mark.parametrize("kwargs", [
    dict(temperature=0.5),
    dict(temperature=1.0),
    dict(temperature=1.7),
    dict(temperature=0.9, top_k=3),
    dict(temperature=1.0, top_p=0.6),
    dict(temperature=1.3, min_p=0.2),
    dict(temperature=0.8, top_k=5, top_p=0.7),
    dict(temperature=1.0, top_k=3, top_p=0.95),
    dict(temperature=1.2, top_k=6, top_p=0.8, min_p=0.1),
], ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_draws_follow_the_filtered_distribution(kwargs):
    logits = random_logits(1, VOCAB, seed=4, scale=1.0).expand(DRAWS, VOCAB).contiguous()
    tokens = sample([SamplingParams(**kwargs)] * DRAWS, logits).sampled_token_ids
    expected = reference_probs(logits[0], **kwargs)
    assert_matches_distribution(tokens, expected)
    if len(kwargs) > 1:  # a real filter removed something
        assert (expected == 0).any()


def test_top_p_keeps_exactly_the_nucleus():
    # Choose top_p halfway between two cumulative sums so the support is unambiguous.
    # Flat logits (scale 0.7): every kept token is likely enough to show up in 4000 draws.
    logits = random_logits(1, VOCAB, seed=5, scale=0.7)[0]
    probs = torch.softmax(logits.double(), -1).sort(descending=True).values
    assert probs.min() > 0.03
    cum = probs.cumsum(0)
    for keep in range(1, VOCAB):
        top_p = float((cum[keep - 1] + cum[keep]) / 2)
        rows = logits.expand(4000, VOCAB).contiguous()
        tokens = sample([SamplingParams(top_p=top_p)] * 4000, rows).sampled_token_ids
        support = set(torch.argsort(logits, descending=True)[:keep + 1].tolist())
        assert set(tokens.unique().tolist()) == support, (keep, top_p)


def test_min_p_applies_before_top_p():
    # vLLM filters by min-p first, so top-p measures mass on the min-p survivors.
    logits = random_logits(1, VOCAB, seed=4, scale=1.0)
    kwargs = dict(top_p=0.9, min_p=0.1)
    expected = reference_probs(logits[0], **kwargs)
    nucleus = reference_probs(logits[0], top_p=0.9)
    min_p_last = nucleus * (nucleus >= 0.1 * nucleus.max())
    assert (expected > 0).sum() == 4 and (min_p_last > 0).sum() == 5
    rows = logits.expand(DRAWS, VOCAB).contiguous()
    assert_matches_distribution(sample([SamplingParams(**kwargs)] * DRAWS, rows).sampled_token_ids,
                                expected)


def test_top_k_ties_at_the_kth_value_are_kept():
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0]]).expand(2000, 5).contiguous()
    tokens = sample([SamplingParams(top_k=2)] * 2000, logits).sampled_token_ids
    assert set(tokens.unique().tolist()) == {0, 2, 3}


def test_per_row_filters_do_not_leak_between_rows():
    logits = random_logits(1, VOCAB, seed=6).expand(3 * 6000, VOCAB).contiguous()
    kinds = [dict(top_k=2), dict(), dict(min_p=0.3)]
    params = [SamplingParams(**kinds[i % 3]) for i in range(logits.shape[0])]
    tokens = sample(params, logits).sampled_token_ids
    for i, kw in enumerate(kinds):
        assert_matches_distribution(tokens[i::3], reference_probs(logits[0], **kw))


def _seeded_run(seed, row_logits, companions, position):
    """Sample 6 steps for one seeded row placed at `position` among `companions`."""
    target = SamplingParams(temperature=0.9, top_k=40, seed=seed)
    generator = make_generator(target, "cpu")
    other_gens = [make_generator(p, "cpu") for p in companions]
    tokens = []
    for step, logits in enumerate(row_logits):
        params = list(companions)
        params.insert(position, target)
        gens = list(other_gens)
        gens.insert(position, generator)
        rest = random_logits(len(companions), logits.numel(), seed=100 + step)
        batch_logits = torch.cat([rest[:position], logits[None], rest[position:]])
        outputs = [[1, 2, 3]] * len(params)
        out = sample(params, batch_logits, outputs=outputs, generators=gens)
        tokens.append(out.sampled_token_ids[position].item())
    return tokens


def test_seeded_rows_reproduce_across_batch_compositions():
    steps = random_logits(6, 300, seed=7, scale=1.0)
    companions = [SamplingParams(temperature=0.0), SamplingParams(top_p=0.8, seed=99),
                  SamplingParams(min_p=0.05, repetition_penalty=1.2),
                  SamplingParams(temperature=1.4, presence_penalty=0.5)]
    alone = _seeded_run(1234, steps, [], 0)
    assert _seeded_run(1234, steps, companions, 2) == alone
    assert _seeded_run(1234, steps, companions[:1], 1) == alone
    assert _seeded_run(1234, steps, companions[::-1], 0) == alone
    assert _seeded_run(4321, steps, companions, 2) != alone


def test_unseeded_rows_follow_the_global_generator():
    logits = random_logits(8, 300, seed=8)
    torch.manual_seed(5)
    first = sample([SamplingParams()] * 8, logits).sampled_token_ids
    torch.manual_seed(5)
    assert torch.equal(sample([SamplingParams()] * 8, logits).sampled_token_ids, first)


def test_penalties_match_hand_computed_logits():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.4, 1.2, 0.0],
                           [2.0, -1.0, 0.5, -0.4, 1.2, 0.0]])
    params = [SamplingParams(repetition_penalty=2.0, frequency_penalty=0.3,
                             presence_penalty=0.2), SamplingParams()]
    batch = SamplingBatch.build(params, [[0, 3], [0]], [[1, 3, 3], [1]], [None, None], 6, "cpu")
    got = apply_penalties(logits, batch.penalties)
    # Seen in prompt or output: 0, 1, 3 (repetition: positive / 2, negative * 2).
    # In output: 1 once, 3 twice (frequency 0.3 per occurrence, presence 0.2 once).
    expected = torch.tensor([
        [2.0 / 2, -1.0 * 2 - 0.3 - 0.2, 0.5, -0.4 * 2 - 0.6 - 0.2, 1.2, 0.0],
        [2.0, -1.0, 0.5, -0.4, 1.2, 0.0]])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    # The sampler applies them before the argmax: token 4 (1.2) beats token 0 (2.0 / 2).
    greedy = [SamplingParams(temperature=0.0, repetition_penalty=2.0), SamplingParams(temperature=0.0)]
    out = sample(greedy, logits, prompts=[[0], [0]])
    assert out.sampled_token_ids.tolist() == [4, 0]


def test_presence_and_frequency_ignore_prompt_tokens():
    logits = random_logits(1, 10, seed=9)
    batch = SamplingBatch.build([SamplingParams(presence_penalty=1.0, frequency_penalty=1.0)],
                                [[0, 1, 2, 3]], [[]], [None], 10, "cpu")
    assert torch.equal(apply_penalties(logits, batch.penalties), logits)


def test_min_tokens_masks_stop_tokens_and_eos_until_reached():
    logits = torch.tensor([[0.0, 5.0, 4.0, 3.0, 1.0]] * 3)
    params = [SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[1])] * 3
    out = sample(params, logits, outputs=[[], [4], [4, 4]], eos_token_ids=[2])
    assert out.sampled_token_ids.tolist() == [3, 3, 1]


def test_forward_never_syncs_with_the_host(monkeypatch):
    """The path a GPU takes (on a CPU, top-p reads values on the host: no device there)."""
    from slipstream.layers import sampler as sampler_module
    monkeypatch.setattr(sampler_module, "CPU_NUCLEUS", False)
    params = [SamplingParams(temperature=0.0, logprobs=2),
              SamplingParams(top_k=5, top_p=0.9, min_p=0.05, seed=3, logprobs=4),
              SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, min_tokens=3,
                             stop_token_ids=[0])]
    batch = SamplingBatch.build(params, [[1, 2]] * 3, [[3]] * 3,
                                [make_generator(p, "cpu") for p in params], 64, "cpu")
    logits = random_logits(3, 64, seed=10)

    def host_sync(*args, **kwargs):
        raise AssertionError("host-device sync inside Sampler.forward")
    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, host_sync)
    out = Sampler()(logits, batch)
    monkeypatch.undo()
    assert out.sampled_token_ids.shape == (3,) and out.logprobs.token_ids.shape == (3, 5)


def test_input_logits_are_not_modified():
    logits = random_logits(4, 30, seed=11)
    before = logits.clone()
    params = [SamplingParams(top_k=3, top_p=0.5, min_p=0.1, repetition_penalty=1.5,
                             min_tokens=1, stop_token_ids=[2], logprobs=1)] * 4
    sample(params, logits, prompts=[[1, 2, 3]] * 4)
    assert torch.equal(logits, before)
    assert math.isfinite(logits.sum().item())


def test_row_argmax_two_pass_equals_argmax_with_ties():
    """The chunked argmax gives torch.argmax's answer, the first index of the
    maximum, also when the maximum repeats within and across chunks."""
    from slipstream.layers.argmax import _argmax_chunks, row_argmax
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 12 * 256, generator=g)
    x[1, [5, 700, 3000]] = 9.0      # ties across chunks
    x[2, [300, 301]] = 9.0          # ties inside one chunk
    x[3] = 0.0                      # all equal
    x[4, -1] = 9.0                  # the last index
    for chunks in (1, 2, 12, 256):
        assert torch.equal(row_argmax(x, chunks), x.argmax(dim=-1)), chunks
    assert _argmax_chunks(128256) == 256 and 128256 % 256 == 0
    assert _argmax_chunks(49152) > 1 and _argmax_chunks(1000) == 1
    # The CPU's rule: at most 16 chunks of at least 512; what the default model's rows use.
    assert _argmax_chunks(49152, cuda=False) == 16 and _argmax_chunks(8191, cuda=False) == 1
    assert _argmax_chunks(128256, cuda=False) == 16 and _argmax_chunks(9973, cuda=False) == 1
    y = torch.randn(4, 49152, generator=g)
    y[0, [100, 40000]] = 7.0
    y[1] = 1.0
    assert torch.equal(row_argmax(y), y.argmax(dim=-1))
    assert torch.equal(row_argmax(y.bfloat16()), y.bfloat16().argmax(dim=-1))


@pytest.mark.parametrize("source", ["c", "topk"])
@pytest.mark.parametrize("kw", [dict(top_p=0.9), dict(top_p=0.5, top_k=40),
                                dict(top_p=0.99, top_k=5000), dict(top_p=0.9, top_k=300)])
def test_cpu_nucleus_candidates_keep_what_the_full_sort_keeps(kw, source, monkeypatch):
    """On a CPU, top-p over a row's likeliest tokens (the C kernels' candidates within a
    distance of the row's largest logit, or torch's topk of NUCLEUS_CANDIDATES) keeps the
    tokens the full sort keeps, with the probabilities of the full sort's renormalised
    distribution; where a row's kept set may reach past them (a flat row, a wide top_k)
    it leaves the row to the full sort (ok False). Peaked rows take the fast path."""
    from slipstream.layers import sampler
    from slipstream.layers.sampler import apply_top_k_top_p, nucleus_candidates
    if source == "topk":
        monkeypatch.setattr(sampler, "_c_candidates", lambda logits: None)
    elif sampler._c_candidates(torch.zeros(1, 8)) is None:
        pytest.skip("no C compiler for the CPU kernels")
    vocab = 4096
    gen = torch.Generator().manual_seed(5)
    fast = []
    for scale in (6.0, 4.0, 3.0, 2.0, 0.3):
        logits = torch.randn(1, vocab, generator=gen) * scale
        top_p = torch.full((1,), kw["top_p"])
        k = min(kw.get("top_k", 0), vocab)        # SamplingBatch keeps top_k in [1, vocab]
        top_k = torch.full((1,), k, dtype=torch.int64) if k else None
        full = apply_top_k_top_p(logits, top_k, k, top_p).softmax(-1)
        weights, ids, ok = nucleus_candidates(logits, top_k, top_p)
        kept = int((full > 0).sum())
        if not ok[0]:
            # topk: kept past its 256; C: a flat row has too many near its largest logit
            assert kept > 200 or 256 < k < vocab or (source == "c" and scale <= 2.0), (scale, kept)
            continue
        assert source == "c" or not 256 < k < vocab
        fast.append(scale)
        got = torch.zeros_like(full).scatter(1, ids, weights)
        got = got / got.sum(-1, keepdim=True)
        assert torch.equal(got > 0, full > 0), (scale, kept)
        torch.testing.assert_close(got, full, atol=1e-6, rtol=1e-4)
    assert 6.0 in fast or 256 < k < vocab
    # A peaked row of a 49k vocabulary, as a language model gives them.
    logits = torch.randn(1, 49152, generator=gen) * 2.0
    logits[0, :40] += torch.linspace(14.0, 6.0, 40)
    k = min(k, 20)
    top_k = torch.full((1,), k, dtype=torch.int64) if k else None
    full = apply_top_k_top_p(logits, top_k, k, top_p).softmax(-1)
    weights, ids, ok = nucleus_candidates(logits, top_k, top_p)
    assert ok[0]
    got = torch.zeros_like(full).scatter(1, ids, weights)
    torch.testing.assert_close(got / got.sum(), full, atol=1e-6, rtol=1e-4)


def test_cpu_nucleus_seeded_row_draws_alike_whatever_shares_the_batch():
    """A seeded row takes the candidates' path or the full sort by its own logits only,
    so it draws the same token alone and beside a row left to the full sort."""
    vocab = 4096
    gen = torch.Generator().manual_seed(9)
    peaked = torch.randn(1, vocab, generator=gen) * 5
    flat = torch.randn(1, vocab, generator=gen) * 0.1
    seeded = SamplingParams(temperature=0.7, top_p=0.9, seed=11)
    other = SamplingParams(temperature=0.7, top_p=0.9)
    alone = [sample([seeded], peaked, generators=[make_generator(seeded, "cpu")])
             .sampled_token_ids[0] for _ in range(2)]
    mixed = sample([seeded, other], torch.cat([peaked, flat]),
                   generators=[make_generator(seeded, "cpu"), None]).sampled_token_ids[0]
    assert alone[0] == alone[1] == mixed


@pytest.mark.parametrize("kw", [dict(temperature=0.7), dict(temperature=0.7, top_p=0.9),
                                dict(temperature=1.3, top_k=3), dict(temperature=1.0, top_k=300, top_p=0.95),
                                dict(temperature=0.8, min_p=0.1, top_p=0.8)])
def test_row_distribution_is_the_samplers(kw):
    """`row_distribution` (one row's kept tokens and probabilities, as the CPU chain
    loop verifies with) equals the hand-written reference, on peaked rows (top-p over
    the candidates) and flat ones (the full sort); `draw` follows it."""
    from slipstream.layers.sampler import draw, row_distribution
    vocab = 4096
    gen = torch.Generator().manual_seed(3)
    for scale in (5.0, 0.2):
        logits = torch.randn(1, vocab, generator=gen) * scale
        params = SamplingParams(**kw)
        batch = SamplingBatch.build([params], [[]], [[]], [None], vocab, "cpu")
        ids, probs = row_distribution(logits, batch)
        dense = probs if ids is None else torch.zeros(vocab).scatter(0, ids, probs)
        want = reference_probs(logits[0], **kw).float()
        assert torch.equal(dense > 1e-9, want > 1e-9), (kw, scale)   # (the reference drops a tail)
        torch.testing.assert_close(dense, want, atol=1e-6, rtol=1e-4)
    small = torch.tensor([[2.0, 0.5, -1.0, 1.0, -30.0, 0.0, 1.5, -2.0]])
    params = SamplingParams(**kw)
    batch = SamplingBatch.build([params], [[]], [[]], [None], VOCAB, "cpu")
    ids, probs = row_distribution(small, batch)
    g = torch.Generator().manual_seed(1)
    tokens = torch.tensor([draw(ids, probs, g) for _ in range(DRAWS)])
    assert_matches_distribution(tokens, reference_probs(small[0], **kw).float())

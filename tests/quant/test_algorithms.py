"""GPTQ, AWQ, SmoothQuant and the mixed-precision allocation on small random layers."""
import itertools

import pytest
import torch

from slipstream.quant import awq, smoothquant
from slipstream.quant.gptq import (HessianAccumulator, dequantized_in_input_order, gptq_quantize,
                                   layer_error)
from slipstream.quant.mixed_precision import solve_exact, solve_greedy
from slipstream.quant.primitives import fake_quantize
from slipstream.quant.rtn import rtn_quantize


def correlated_inputs(n=1024, d=256, rank=24, seed=0):
    """Inputs on a low-rank subspace plus noise, with channels of very different scale."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, rank, generator=g) @ torch.randn(rank, d, generator=g)
    x = x + 0.3 * torch.randn(n, d, generator=g)
    return x * torch.linspace(0.2, 3.0, d)[torch.randperm(d, generator=g)]


@pytest.mark.parametrize("bits,group", [(4, 64), (3, 64), (4, None)])
def test_gptq_output_error_is_below_rtn(bits, group):
    x = correlated_inputs()
    w = torch.randn(96, 256, generator=torch.Generator().manual_seed(1)) * 0.05
    acc = HessianAccumulator(256)
    acc.add(x[:512])
    acc.add(x[512:])
    rtn = rtn_quantize(w, bits, group).dequantize()
    qt, perm = gptq_quantize(w, acc.value(), bits, group, block_size=32)
    assert perm is None
    gptq = dequantized_in_input_order(qt, perm)
    e_rtn, e_gptq = layer_error(w, rtn, x), layer_error(w, gptq, x)
    assert e_gptq < 0.5 * e_rtn
    # The codes are real b-bit codes with per-group parameters.
    assert int(qt.codes.max()) <= 2 ** bits - 1
    qa, pa = gptq_quantize(w, acc.value(), bits, group, act_order=True)
    assert sorted(pa.tolist()) == list(range(256))
    assert layer_error(w, dequantized_in_input_order(qa, pa), x) < e_rtn
    # Static groups: act-order quantization, codes stored in input order (no permutation).
    qs, ps = gptq_quantize(w, acc.value(), bits, group, act_order=True, static_groups=True)
    assert ps is None and layer_error(w, qs.dequantize(), x) < 0.7 * e_rtn
    # The Hessian-weighted range search lowers the output error further.
    qc, pc = gptq_quantize(w, acc.value(), bits, group, act_order=True, clip_grid=20)
    assert layer_error(w, dequantized_in_input_order(qc, pc), x) <= \
        1.05 * layer_error(w, dequantized_in_input_order(qa, pa), x)


def test_gptq_range_search_with_separate_ends_is_no_worse_per_group():
    from slipstream.quant.gptq import group_qparams
    from slipstream.quant.primitives import quantize_codes
    g = torch.Generator().manual_seed(3)
    w = torch.randn(40, 64, generator=g)
    w[::3, 7] = 6.0                             # one-sided outliers: the high end only
    d = torch.rand(64, generator=g) + 0.1

    def err(s, z):
        q = (quantize_codes(w, s, z, 4).float() - z) * s
        return ((q - w).pow(2) * d).sum(1)
    one = err(*group_qparams(w, d, 4, False, 10))
    two = err(*group_qparams(w, d, 4, False, 10, separate=True))
    assert (two <= one + 1e-6).all() and two.sum() < 0.99 * one.sum()


def test_gptq_asymmetric_calibration_targets_the_reference_outputs():
    # x: inputs from quantized layers before this one; x_ref: the unquantized model's.
    x_ref = correlated_inputs(seed=4)
    x = x_ref + 0.3 * torch.randn(x_ref.shape, generator=torch.Generator().manual_seed(5)) \
        * x_ref.std(0)
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(6)) * 0.05
    h = 2 * x.t() @ x / x.shape[0]
    cross = 2 * (x_ref - x).t() @ x / x.shape[0]

    def err(qt, perm):
        w_hat = dequantized_in_input_order(qt, perm)
        return (x @ w_hat.t() - x_ref @ w.t()).pow(2).mean().item()
    plain = err(*gptq_quantize(w, h, 4, 64, act_order=True))
    asym = err(*gptq_quantize(w, h, 4, 64, act_order=True, cross=cross))
    assert asym < 0.8 * plain
    # cross_scale 0 is plain GPTQ.
    same = gptq_quantize(w, h, 4, 64, cross=cross, cross_scale=0.0)[0]
    assert torch.equal(same.codes, gptq_quantize(w, h, 4, 64)[0].codes)


def test_gptq_on_uncorrelated_inputs_is_close_to_rtn_and_exact_weights_stay():
    # With H = identity there is nothing to compensate through: GPTQ reduces to RTN.
    w = torch.randn(32, 128)
    qt, _ = gptq_quantize(w, 2 * torch.eye(128), 4, 32, damp=0.0)
    torch.testing.assert_close(qt.dequantize(), rtn_quantize(w, 4, 32).dequantize())


def test_gptq_dead_inputs_get_zero_weight():
    x = correlated_inputs(d=64)
    x[:, 5] = 0
    acc = HessianAccumulator(64)
    acc.add(x)
    w = torch.randn(8, 64)
    qt, _ = gptq_quantize(w, acc.value(), 4, 32)
    assert qt.dequantize()[:, 5].abs().max() <= qt.scale.max()


def test_awq_scale_search_lowers_the_output_error():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(512, 256, generator=g)
    x[:, :4] *= 30.0                        # a few salient channels
    w = torch.randn(64, 256, generator=g) * 0.05
    res = awq.search_scales(w, x, bits=4, group_size=64, grid=10)
    assert res.grid[0] == 0.0 and res.alpha > 0
    assert min(res.errors) < 0.9 * res.errors[0]      # alpha = 0 is plain RTN
    # Exact equivalence before rounding: (x / s) (W s)^T = x W^T.
    s = res.scales
    torch.testing.assert_close((x / s) @ (w * s).t(), x @ w.t(), atol=1e-4, rtol=1e-4)
    w_hat = fake_quantize(w * s, 4, False, "group", 64) / s
    assert layer_error(w, w_hat, x) == pytest.approx(min(res.errors), rel=1e-4)


def test_awq_duo_scaling_candidates_can_only_lower_the_searched_error():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(512, 160, generator=g)
    x[:, :4] *= 30.0
    w = torch.randn(64, 160, generator=g) * 0.05
    w[:, 100:] *= 8.0                           # columns of larger weights
    wm = awq.weight_mean(w, 64)
    assert wm.shape == (160,) and 0 < wm.min() and wm.max() <= 1
    plain = awq.search_scales(w, x, bits=4, group_size=64, grid=10)
    duo = awq.search_scales(w, x, bits=4, group_size=64, grid=10, w_mean=wm)
    assert len(duo.errors) == 2 * len(plain.errors)
    assert duo.errors[:11] == plain.errors and min(duo.errors) <= min(plain.errors)
    by_gram = awq.search_scales(w, None, 4, 64, grid=10, x_abs_mean=x.abs().mean(0),
                                w_mean=wm, gram=x.t() @ x / x.shape[0])
    assert by_gram.alpha == duo.alpha and by_gram.duo == duo.duo
    assert by_gram.errors == pytest.approx(duo.errors, rel=1e-4)
    s = awq.awq_scales(x.abs().mean(0), 0.5, wm)
    assert (s.max() * s.min()).item() == pytest.approx(1.0, rel=1e-5)


def test_awq_clip_search_lowers_the_output_error_and_only_shrinks():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(256, 160, generator=g)       # 160 = 2 x 64 + a 32-wide last group
    w = torch.randn(48, 160, generator=g) * 0.05
    w[::5, 3] = 0.6                             # outliers stretch their groups' ranges
    wc = awq.search_clip(w, x, bits=4, group_size=64, grid=10)
    assert wc.shape == w.shape and (wc.abs() <= w.abs() + 1e-7).all()
    plain = fake_quantize(w, 4, False, "group", 64)
    clipped = fake_quantize(wc, 4, False, "group", 64)
    assert layer_error(w, clipped, x) < 0.95 * layer_error(w, plain, x)
    # The same search from the inputs' Gram matrix alone (all calibration rows, no sample).
    torch.testing.assert_close(awq.search_clip(w, None, 4, 64, grid=10,
                                               gram=x.t() @ x / x.shape[0]), wc)


def test_smoothquant_alpha_search_beats_no_smoothing():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(256, 64, generator=g)
    x[:, 5] *= 50.0                              # an activation outlier channel
    w = torch.randn(32, 64, generator=g)
    alpha, s, errors = smoothquant.search_alpha(x, x.abs().amax(0), [w], grid=10)
    assert len(errors) == 12 and errors[0] == smoothquant.w8a8_output_error(x, [w],
                                                                           torch.ones(64))
    assert alpha is not None and min(errors) < 0.5 * errors[0]   # errors[0]: no smoothing
    # A tie (GQA: one scale per value channel) makes the chosen scales equal within groups.
    tie = lambda v, op: v.view(-1, 2, 8).amax(1, keepdim=True).expand(-1, 2, 8).reshape(-1)  # noqa: E731
    _, st, _ = smoothquant.search_alpha(x, x.abs().amax(0), [w], grid=4, tie=tie)
    assert torch.equal(st.view(-1, 2, 8)[:, 0], st.view(-1, 2, 8)[:, 1])


def test_smoothquant_scales_flatten_activation_outliers_and_folding_is_exact():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 32, generator=g)
    x[:, 7] *= 40.0
    norm_w = torch.rand(32, generator=g) + 0.5
    w1, w2 = torch.randn(16, 32, generator=g), torch.randn(24, 32, generator=g)
    y1, y2 = (x * norm_w) @ w1.t(), (x * norm_w) @ w2.t()
    s = smoothquant.smooth_scales((x * norm_w).abs().amax(0), [w1, w2], alpha=0.5)
    before = (x * norm_w).abs().amax(0)
    nw, a, b = norm_w.clone(), w1.clone(), w2.clone()
    smoothquant.fold_into_norm(nw, [a, b], s)
    after = (x * nw).abs().amax(0)
    assert after.max() / after.median() < before.max() / before.median() / 3
    torch.testing.assert_close((x * nw) @ a.t(), y1, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close((x * nw) @ b.t(), y2, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="alpha"):
        smoothquant.smooth_scales(before, [w1], alpha=1.5)


def test_fold_into_rows_keeps_a_linear_pair_exact():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(8, 16, generator=g)
    up, bias, down = torch.randn(12, 16, generator=g), torch.randn(12, generator=g), \
        torch.randn(5, 12, generator=g)
    y = (x @ up.t() + bias) @ down.t()
    s = torch.rand(12, generator=g) + 0.1
    smoothquant.fold_into_rows(up, bias, down, s)
    torch.testing.assert_close((x @ up.t() + bias) @ down.t(), y, atol=1e-4, rtol=1e-4)


def _brute_force(errs, sizes, budget):
    best = None
    for bits in itertools.product(*[sorted(e) for e in errs]):
        if sum(s * b for s, b in zip(sizes, bits)) <= budget:
            total = sum(e[b] for e, b in zip(errs, bits))
            best = total if best is None or total < best else best
    return best


@pytest.mark.parametrize("seed", range(5))
def test_mixed_precision_dp_is_optimal_and_greedy_feasible(seed):
    g = torch.Generator().manual_seed(seed)
    sizes = [64 * int(k) for k in torch.randint(1, 6, (6,), generator=g)]
    errs = []
    for _ in sizes:
        base = float(torch.rand(1, generator=g)) * 10 + 0.1
        errs.append({b: base * 4.0 ** (-b) for b in (2, 3, 4, 8)})
    budget = 3.5 * sum(sizes)
    exact = solve_exact(errs, sizes, budget)
    greedy = solve_greedy(errs, sizes, budget)
    for bits in (exact, greedy):
        assert sum(s * b for s, b in zip(sizes, bits)) <= budget
    total = lambda bits: sum(e[b] for e, b in zip(errs, bits))  # noqa: E731
    assert total(exact) == pytest.approx(_brute_force(errs, sizes, budget))
    assert total(greedy) >= total(exact) - 1e-12
    with pytest.raises(ValueError, match="avg_bits"):
        solve_exact(errs, sizes, 1.0 * sum(sizes))

"""Speculative decoding theory (chapter 3.3-3.4) against hand-computed values."""
import numpy as np
import pytest

from slipstream.analysis import specdec


def _tau_by_definition(alpha, gamma):
    # Rejected at draft j (j - 1 accepted + 1 resampled) or all accepted (+1 bonus).
    return sum(j * alpha ** (j - 1) * (1 - alpha) for j in range(1, gamma + 1)) \
        + (gamma + 1) * alpha ** gamma


@pytest.mark.parametrize("alpha, gamma, tau", [
    (0.8, 4, 3.3616),      # (1 - 0.8^5) / 0.2 = 0.67232 / 0.2
    (0.9, 4, 4.0951),      # (1 - 0.9^5) / 0.1 = 0.40951 / 0.1
    (0.8, 1, 1.8),
    (0.9, 8, 6.12579511),  # (1 - 0.9^9) / 0.1
    (1.0, 5, 6.0),
    (0.0, 5, 1.0),
])
def test_expected_tokens(alpha, gamma, tau):
    assert specdec.expected_tokens(alpha, gamma) == pytest.approx(tau, abs=1e-8)
    assert specdec.expected_tokens(alpha, gamma) == pytest.approx(_tau_by_definition(alpha, gamma))


@pytest.mark.parametrize("alpha, gamma, c, speedup", [
    (0.8, 4, 0.1, 3.3616 / 1.4),    # 2.4011
    (0.9, 4, 0.1, 4.0951 / 1.4),    # 2.9251
    (0.8, 4, 0.0, 3.3616),
    (0.8, 2, 0.5, 2.44 / 2.0),      # the chapter's "c > 0.5 cancels the gain": still 1.22x
])
def test_speedup(alpha, gamma, c, speedup):
    assert specdec.speedup(alpha, gamma, c) == pytest.approx(speedup, rel=1e-9)


def test_speedup_limit():
    assert specdec.max_speedup(0.8) == pytest.approx(5.0)
    assert specdec.max_speedup(0.9) == pytest.approx(10.0)
    assert specdec.speedup(0.9, 400, 0.0) == pytest.approx(10.0, rel=1e-9)


@pytest.mark.parametrize("alpha, c", [(0.8, 0.05), (0.9, 0.1), (0.6, 0.2), (0.95, 0.02)])
def test_best_gamma_is_the_argmax(alpha, c):
    speeds = {g: specdec.speedup(alpha, g, c) for g in range(1, 65)}
    best = specdec.best_gamma(alpha, c)
    assert speeds[best] == max(speeds.values())


def test_best_gamma_hand_values():
    # alpha 0.8, c 0.1: S(3) = 2.952 / 1.3 = 2.2708, S(4) = 2.4011, S(5) = 3.68928 / 1.5 =
    # 2.4595, S(6) = 3.95142 / 1.6 = 2.4696, S(7) = 4.16114 / 1.7 = 2.4477 -> 6.
    assert specdec.best_gamma(0.8, 0.1) == 6
    assert specdec.best_gamma(0.3, 1.0) == 1


def test_acceptance_is_one_minus_tvd():
    p, q = [0.5, 0.3, 0.2], [0.2, 0.3, 0.5]
    # sum min = 0.2 + 0.3 + 0.2; TVD = (0.3 + 0 + 0.3) / 2
    assert specdec.acceptance_rate(p, q) == pytest.approx(0.7)
    assert specdec.total_variation(p, q) == pytest.approx(0.3)
    assert specdec.acceptance_rate(p, p) == pytest.approx(1.0)
    assert specdec.acceptance_rate([1, 0], [0, 1]) == 0.0
    with pytest.raises(ValueError):
        specdec.acceptance_rate([0.5, 0.6], [0.5, 0.5])
    with pytest.raises(ValueError):
        specdec.acceptance_rate([1.0], [0.5, 0.5])


def test_acceptance_matches_rejection_sampling():
    """Sample x ~ q, accept with min(1, p(x) / q(x)): the acceptance frequency
    converges to 1 - TVD (200k draws: standard error ~0.001, tolerance 0.005)."""
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(50))
    q = rng.dirichlet(np.ones(50))
    x = rng.choice(50, size=200_000, p=q)
    accepted = rng.random(200_000) < np.minimum(1.0, p[x] / q[x])
    assert accepted.mean() == pytest.approx(specdec.acceptance_rate(p, q), abs=0.005)


def test_breakeven_batch():
    """H100 (critical batch 295.3 for bf16 weights), alpha 0.8, gamma 4, c 0.05:
    B* = 295.3 x (3.3616 - 0.2) / 5 = 186.7; beyond it speculation is slower."""
    crit = 989.4 / 3.35
    b = specdec.breakeven_batch(0.8, 4, 0.05, crit)
    assert b == pytest.approx(crit * (3.3616 - 0.2) / 5, rel=1e-9)
    assert specdec.speedup_at_batch(0.8, 4, 0.05, b, crit) == pytest.approx(1.0, rel=1e-9)
    assert specdec.speedup_at_batch(0.8, 4, 0.05, b * 1.1, crit) < 1.0
    # Small batches see the unbatched speedup.
    assert specdec.speedup_at_batch(0.8, 4, 0.05, 8, crit) == pytest.approx(
        specdec.speedup(0.8, 4, 0.05))
    # No gain even at batch 1: nothing to lose past any batch.
    assert specdec.breakeven_batch(0.3, 4, 0.5, crit) == 0.0


def test_invalid_inputs():
    for bad in ((1.2, 4, 0.1), (0.5, -1, 0.1), (0.5, 4, -0.1), (0.5, 2.5, 0.1)):
        with pytest.raises(ValueError):
            specdec.speedup(*bad)


@pytest.mark.parametrize("alpha, gamma", [(0.3, 2), (0.8, 4), (0.95, 7)])
def test_alpha_from_tau_inverts_expected_tokens(alpha, gamma):
    tau = specdec.expected_tokens(alpha, gamma)
    assert specdec.alpha_from_tau(tau, gamma) == pytest.approx(alpha, abs=1e-9)


def test_auto_off_rule():
    # Small batch, good draft: speculate; the best length is the argmax of speedup_at_batch.
    g = specdec.best_gamma_at_batch(0.8, 0.05, 1, 64)
    speeds = [specdec.speedup_at_batch(0.8, k, 0.05, 1, 64) for k in range(1, 17)]
    assert g == 1 + int(np.argmax(speeds)) and speeds[g - 1] > 1
    # Past the break-even batch every length loses: off.
    for gamma in range(1, 17):
        assert specdec.speedup_at_batch(0.8, gamma, 0.05, 256, 64) < 1
    assert specdec.best_gamma_at_batch(0.8, 0.05, 256, 64) == 0
    # A draft as slow as the target never pays.
    assert specdec.best_gamma_at_batch(0.5, 1.0, 1, 64) == 0
    # The measured form agrees with the chain model: tau from alpha, gamma + 1 verify tokens.
    tau = specdec.expected_tokens(0.8, 4)
    assert specdec.round_speedup(tau, 5, 4 * 0.05, 8, 64) == pytest.approx(
        specdec.speedup_at_batch(0.8, 4, 0.05, 8, 64))


def test_critical_batch_from_the_roofline():
    from slipstream.analysis.hardware import GPUS
    from tests.models.tiny_models import make_hf_model, model_config_of
    mc = model_config_of(make_hf_model("llama2"))
    bc = specdec.critical_batch_for(mc, GPUS["H200"], context=16)
    assert bc > 1

"""The auto-off rule fed with measurements."""
import torch

from slipstream.config import SpecConfig
from slipstream.spec.governor import SpecGovernor, bucket
from tests.models.tiny_models import make_hf_model, model_config_of


def _gov(method="ngram", k=4, probe_every=4):
    g = SpecGovernor(SpecConfig(method=method, num_speculative_tokens=k),
                     model_config_of(make_hf_model("llama2")), torch.device("cpu"),
                     probe_every=probe_every, plain_every=1000)
    g.critical_batch = 32.0
    return g


def test_buckets_are_powers_of_two():
    assert [bucket(b) for b in (1, 2, 3, 4, 5, 64, 65)] == [1, 2, 4, 4, 8, 64, 128]


def test_speculates_until_measured_then_measures_plain_then_follows_measurements():
    g = _gov()
    assert g.num_tokens(1) == 4                   # nothing measured: try
    g.observe_round(emitted=4, requests=1, drafted=4)   # tau 4
    g.observe_draft(0.0001)
    g.observe_step(0.012, 1, "spec")
    assert g.num_tokens(1) == 0                   # plain(1) unknown: one plain step
    g.observe_step(0.010, 1, "plain")
    assert g.num_tokens(1) >= 1
    assert abs(g.predicted_speedup(1) - 4 * 0.010 / (0.012 + 0.0001)) < 1e-9
    # At a batch far past Bc the 5 verified tokens per request cost 5x: off.
    # Where a better draft could still pay (here a verifying step measured at
    # 1.2 plain steps), a probe round every 4th step drafts for one request
    # (a probe measured as costing next to nothing there).
    g.observe_step(0.0100, 512, "plain")
    g.observe_step(0.0101, 512, "probe")
    g.observe_step(0.0120, 512, "spec")
    g.tau, g.draft_per_request = 1.0, 0.0
    asks, limits = [], []
    for _ in range(8):
        asks.append(g.num_tokens(512))
        limits.append(g.request_limit)
    assert asks.count(0) == 6 and asks.count(4) == 2
    assert [lim for a, lim in zip(asks, limits) if a] == [1, 1]
    # Where even 5 tokens a round (every draft accepted) would not pay: no probes.
    g.observe_step(0.0600, 256, "plain")
    g.observe_step(0.3500, 256, "spec")
    assert g.predicted_speedup(256) * 5 / g.tau <= 1
    assert [g.num_tokens(256) for _ in range(8)] == [0] * 8


def test_slow_verification_switches_off_even_below_the_critical_batch():
    # What the roofline cannot see: the verify step costs 5x a plain step.
    g = _gov("eagle")
    g.observe_round(emitted=3, requests=1, drafted=16)
    g.observe_draft(0.001)
    g.observe_step(0.050, 1, "spec")
    g.observe_step(0.010, 1, "plain")
    assert g.predicted_speedup(1) < 1 and g.num_tokens(1) == 0


def test_per_request_drafting_cost_turns_large_batches_off():
    g = _gov("eagle")
    g.observe_round(emitted=4, requests=1, drafted=16)
    g.observe_draft(0.001)
    g.observe_step(0.006, 1, "spec")
    g.observe_step(0.002, 1, "plain")
    assert g.predicted_speedup(1) > 1
    g.observe_step(0.004, 64, "plain")
    # 64 requests drafted one by one cost 64 x 1 ms against a 4 ms plain step.
    assert g.predicted_speedup(64) < 0.1 and g.num_tokens(64) == 0


def test_a_useless_draft_is_switched_off_at_batch_one():
    g = _gov("eagle")
    g.observe_round(emitted=1, requests=1, drafted=16)  # nothing accepted
    g.observe_draft(0.02)
    g.observe_step(0.01, 1, "spec")
    assert g.predicted_speedup(1) < 1 and g.num_tokens(1) == 0


def test_auto_off_can_be_disabled():
    g = SpecGovernor(SpecConfig(method="ngram", auto_off=False),
                     model_config_of(make_hf_model("llama2")), torch.device("cpu"))
    g.observe_round(1, 1, 4); g.observe_draft(1.0); g.observe_step(0.01, 1, "spec")
    assert g.num_tokens(10_000) == 4


def test_unmeasured_probes_among_other_requests_start_late_then_follow_their_cost():
    g = _gov("ngram", probe_every=4)
    g.observe_round(emitted=1, requests=1, drafted=4)
    g.observe_draft(0.0)
    g.observe_step(0.002, 1, "spec")
    g.observe_step(0.001, 1, "plain")
    g.observe_step(0.001, 64, "plain")
    g.observe_step(0.0012, 64, "spec")     # off (tau 1), but a better draft could pay
    assert g.num_tokens(64) == 0
    # No probe measured at 64: assumed to cost 4 plain steps -> one per 801 steps
    # (probes above batch 1 take at most 0.5% of the time).
    assert g._probe_interval(64) == 801
    asks = [g.num_tokens(64) for _ in range(1000)]
    assert asks.count(0) == 999 and asks.index(4) == 799
    g.observe_step(0.011, 64, "probe")     # measured: 10 plain steps extra
    assert 1995 <= g._probe_interval(64) <= 2001


def test_expensive_probes_are_spaced_out():
    g = _gov("medusa", probe_every=4)
    g.observe_round(emitted=1, requests=1, drafted=15)
    g.observe_draft(0.001)
    g.observe_step(0.070, 1, "spec")      # a 16-row verification costs 7 plain steps
    g.observe_step(0.010, 1, "plain")
    assert g._probe_interval(1) == int(50 * 0.061 / 0.010) + 1
    asks = [g.num_tokens(1) for _ in range(2 * g._probe_interval(1))]
    assert asks.count(0) == len(asks) - 2


def test_cpu_costs_verified_tokens_by_measurement():
    """On a CPU a verification step costs 1 + r (n - 1) plain steps: r is
    CPU_TOKEN_COST until both steps are measured, then the measured share; the
    chain length adds r to each drafted token's cost."""
    from slipstream.analysis import specdec
    from slipstream.spec.governor import CPU_TOKEN_COST
    g = _gov(k=8)
    assert g.cpu
    g.observe_round(emitted=3, requests=1, drafted=4)          # tau 3, 5 rows verified
    g.observe_draft(0.0)
    g.observe_step(0.010, 1, "plain")
    want = 3 * 0.010 / (0.010 * (1 + CPU_TOKEN_COST * 4))      # spec step not measured yet
    assert abs(g.predicted_speedup(1) - want) < 1e-9
    g.observe_step(0.014, 1, "spec")                           # r = 0.4 / 4 = 0.1
    assert abs(g._token_cost(1) - 0.1) < 1e-9
    assert abs(g.predicted_speedup(1) - 3 * 0.010 / 0.014) < 1e-9
    g.last_k = 4
    k = g.num_tokens(1)
    alpha = specdec.alpha_from_tau(3.0, 4)
    assert k == specdec.best_gamma(alpha, 0.1, 8) and 1 <= k < 8
    for _ in range(30):                                        # dearer verification: shorter chains
        g.observe_step(0.030, 1, "spec")
    assert g._token_cost(1) > 0.2
    g.last_k = 4
    assert g.num_tokens(1) <= k


def _quiet_at_64():
    """A governor whose measurements make batch 64 quiet (64 x 1 ms of drafting)."""
    g = _gov("eagle")
    g.observe_round(emitted=3, requests=1, drafted=16)
    g.observe_draft(0.001)
    g.observe_step(0.006, 1, "spec")
    g.observe_step(0.002, 1, "plain")
    g.observe_step(0.004, 64, "plain")
    return g


def test_quiet_where_no_round_could_pay():
    g = _quiet_at_64()
    assert g.num_tokens(64) == 0 and g.quiet          # 64 x 1 ms of drafting: never pays
    g.num_tokens(1)
    assert not g.quiet                                # batch 1 keeps its probes


def test_quiet_answer_stands_until_a_measurement_or_the_batch_changes():
    """Asked every step while quiet, the rule is not re-evaluated until something
    it reads changes: a measurement other than a plain step's, the batch size, or a
    value set directly; the quiet steps' own timings are read every QUIET_RECHECK steps."""
    from slipstream.spec.governor import QUIET_RECHECK
    g = _quiet_at_64()
    calls = []
    real = g.predicted_speedup
    g.predicted_speedup = lambda b: calls.append(b) or real(b)
    assert g.num_tokens(64) == 0 and g.quiet and len(calls) == 1
    for _ in range(5):
        assert g.num_tokens(64) == 0 and g.quiet and g.request_limit is None
        g.observe_step(0.004, 64, "plain")        # the quiet step's own timing
    assert len(calls) == 1
    for _ in range(QUIET_RECHECK - 6):
        g.num_tokens(64)
    assert len(calls) == 1
    assert g.num_tokens(64) == 0 and g.quiet and len(calls) == 2   # read again
    g.observe_step(0.006, 1, "spec")              # another measurement: evaluated again
    assert g.num_tokens(64) == 0 and len(calls) == 3
    assert g.num_tokens(48) == 0 and len(calls) == 4   # another batch size
    g.num_tokens(1)
    assert not g.quiet                            # batch 1 keeps its probes
    assert g.num_tokens(64) == 0 and g.quiet and len(calls) == 6
    g.draft_per_request = 0.0                     # set directly: evaluated again
    g.num_tokens(64)
    assert len(calls) == 7

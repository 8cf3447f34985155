"""The auto-off rule fed with measurements."""
import torch

from slipstream.config import SpecConfig
from slipstream.spec.governor import SpecGovernor
from tests.models.tiny_models import make_hf_model, model_config_of


def _gov(method="ngram", k=4):
    g = SpecGovernor(SpecConfig(method=method, num_speculative_tokens=k),
                     model_config_of(make_hf_model("llama2")), torch.device("cpu"), probe_every=4)
    g.critical_batch = 32.0
    return g


def test_speculates_until_measured_then_follows_the_roofline():
    g = _gov()
    assert g.num_tokens(1) == 4                   # nothing measured: try
    g.observe_round(emitted=4, requests=1, drafted=4)   # tau 4 with 4 drafts: alpha ~ 0.93
    g.observe_draft(0.0001)
    g.observe_step(0.01)
    assert g.num_tokens(1) >= 1
    assert g.predicted_speedup(1) > 2
    # At a batch far past Bc the 5 verified tokens per request cost 5x: off,
    # except for a probe round every 4th step.
    asks = [g.num_tokens(512) for _ in range(8)]
    assert asks.count(0) == 6 and asks.count(4) == 2


def test_a_useless_draft_is_switched_off_at_batch_one():
    g = _gov("eagle")
    g.observe_round(emitted=1, requests=1, drafted=16)  # nothing accepted
    g.observe_draft(0.02)
    g.observe_step(0.01)
    assert g.predicted_speedup(1) < 1 and g.num_tokens(1) == 0


def test_auto_off_can_be_disabled():
    g = SpecGovernor(SpecConfig(method="ngram", auto_off=False),
                     model_config_of(make_hf_model("llama2")), torch.device("cpu"))
    g.observe_round(1, 1, 4); g.observe_draft(1.0); g.observe_step(0.01)
    assert g.num_tokens(10_000) == 4

"""EAGLE-3 features: the target returns chosen layers' outputs beside its final
hidden states, a head fuses them (`target_feature`), trains on them with the
training-time-test passes, saves and loads its layers, and drafts with them."""
import pytest
import torch

from slipstream.spec.eagle_head import EagleHead, eagle3_layers
from slipstream.spec.train import eagle_shape_for, train_eagle, ttt_features
from slipstream.spec.train_data import dense_output_weights, features_of
from slipstream.spec.train_run import feature_taps
from tests.models.tiny_models import make_hf_model, make_ours
from tests.spec.conftest import repeating_samples


@pytest.fixture(scope="module")
def hf_and_ours():
    hf = make_hf_model("llama_gqa", seed=0)
    return hf, make_ours(hf)


def test_taps_are_the_layer_outputs(hf_and_ours):
    hf, ours = hf_and_ours
    tokens = torch.arange(3, 20) % 90
    plain = features_of(ours, tokens)
    ours.set_feature_taps((0,))
    try:
        wide = features_of(ours, tokens)
    finally:
        ours.set_feature_taps(())
    h = ours.config.hidden_size
    assert wide.shape == (tokens.shape[0], 2 * h)
    assert torch.equal(wide[:, :h], plain)
    with torch.no_grad():
        ref = hf(tokens[None], output_hidden_states=True).hidden_states[1][0]   # after layer 0
    torch.testing.assert_close(wide[:, h:], ref, atol=1e-4, rtol=1e-4)
    # The logits read the final states of wide rows.
    assert torch.equal(ours.compute_logits(wide), ours.compute_logits(plain))


def test_tap_layers_are_checked(hf_and_ours):
    _, ours = hf_and_ours
    for bad in ((1, 0), (0, 0), (5,), (-1,)):
        with pytest.raises(ValueError, match="feature taps"):
            ours.set_feature_taps(bad)
    assert eagle3_layers(30) == (2, 15, 27) and eagle3_layers(2) == (0, 1)
    assert feature_taps("eagle3", 32) == (2, 16, 29) and feature_taps("final", 32) == ()
    assert feature_taps("9,3", 32) == (3, 9)
    with pytest.raises(ValueError, match="feature-layers"):
        feature_taps("low", 32)


def test_head_reads_its_layers_and_round_trips(hf_and_ours, tmp_path):
    _, ours = hf_and_ours
    shape = eagle_shape_for(ours.config, 64, (0, 1))
    head = EagleHead(shape)
    h = shape.hidden_size
    rows = torch.randn(5, 3 * h)
    f = head.target_feature(rows)
    assert f.shape == (5, h)
    # Only the taps count, each normalised: scaling a tap or changing the final state
    # leaves the feature as it is.
    other = rows.clone()
    other[:, :h] = 0
    other[:, h:2 * h] *= 7
    torch.testing.assert_close(head.target_feature(other), f, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="EAGLE-3 head"):
        head.target_feature(rows[:, :2 * h])
    head.save(tmp_path / "e3.safetensors")
    again = EagleHead.load(tmp_path / "e3.safetensors")
    assert again.shape == shape and again.shape.taps == (0, 1)
    torch.testing.assert_close(again.target_feature(rows), f, atol=1e-2, rtol=1e-2)


def test_eagle3_head_trains_on_the_taps(hf_and_ours):
    _, ours = hf_and_ours
    lm, emb = dense_output_weights(ours)
    plain = repeating_samples(ours)
    with pytest.raises(ValueError, match="columns"):
        train_eagle(lm, emb, plain, ours.config, epochs=1, feature_layers=(0, 1))
    ours.set_feature_taps((0, 1))
    try:
        s = repeating_samples(ours)
    finally:
        ours.set_feature_taps(())
    logs = []
    head = train_eagle(lm, emb, s, ours.config, epochs=8, lr=3e-3, ttt_steps=2,
                       batch_tokens=64, intermediate_size=64, log=logs.append,
                       feature_layers=(0, 1))
    acc = [eval(line.split("depth ")[1]) for line in logs]
    assert head.shape.taps == (0, 1)
    assert acc[-1][0] > acc[0][0] + 0.15


def test_ttt_passes_compute_what_drafting_computes_with_taps(hf_and_ours):
    """The first pass reads the fused taps; later passes the head's own outputs,
    as drafting does (spec/eagle.py feeds target rows through target_feature)."""
    _, ours = hf_and_ours
    torch.manual_seed(0)
    head = EagleHead(eagle_shape_for(ours.config, 64, (0, 1))).eval()
    n, h = 7, ours.config.hidden_size
    e, rows = torch.randn(1, n, h), torch.randn(1, n, 3 * h)
    with torch.no_grad():
        passes = ttt_features(head, e, head.target_feature(rows), 2)
        for j in range(1, n):
            r = j - 1
            f, k, v = head(e[0, :r + 1], head.target_feature(rows[0, :r + 1]),
                           torch.arange(r + 1), None, None)
            assert torch.allclose(f[-1], passes[0][0, r], atol=1e-5)
            f2, _, _ = head(e[0, r + 1:r + 2], f[-1:], torch.tensor([r + 1]), (k, v), None)
            assert torch.allclose(f2[0], passes[1][0, r + 1], atol=1e-5)

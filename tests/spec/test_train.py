"""Head training on a tiny target: losses fall and the heads load back."""
import torch

from slipstream.spec.eagle import EagleHead, EagleProposer
from slipstream.spec.medusa import MedusaHeads
from slipstream.spec.train import Sample, features_of, train_eagle, train_medusa


def _samples(model, n=6, length=24):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        # A repeating pattern: learnable from the features.
        base = torch.randint(0, 96, (5,), generator=g)
        tokens = base.repeat(length // 5 + 1)[:length]
        out.append(Sample(tokens, features_of(model, tokens), 4))
    return out


def test_medusa_training_learns_and_round_trips(tiny_target, tmp_path):
    logs = []
    heads = train_medusa(tiny_target, _samples(tiny_target), num_heads=2, epochs=30, lr=3e-3,
                         batch=64, log=logs.append)
    first, last = logs[0], logs[-1]
    assert float(last.split("loss ")[1].split(",")[0]) < float(first.split("loss ")[1].split(",")[0])
    heads.save(tmp_path / "m.safetensors")
    again = MedusaHeads.load(tmp_path / "m.safetensors")
    x = torch.randn(3, tiny_target.config.hidden_size)
    assert torch.allclose(again(x), heads(x), atol=1e-2)


def test_eagle_training_learns_and_round_trips(tiny_target, tmp_path):
    logs = []
    head = train_eagle(tiny_target, _samples(tiny_target), epochs=8, lr=3e-3,
                       intermediate_size=64, log=logs.append)
    acc = [float(line.rsplit(" ", 1)[1]) for line in logs]
    assert acc[-1] > acc[0] + 0.15
    head.save(tmp_path / "e.safetensors")
    again = EagleHead.load(tmp_path / "e.safetensors")
    assert again.shape == head.shape
    p = EagleProposer(again, tiny_target.model.embed_tokens, tiny_target.compute_logits, 3, 2, 2, 5)
    assert p is not None

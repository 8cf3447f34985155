import pytest
import torch

from tests.models.tiny_models import make_hf_model, make_ours


@pytest.fixture(scope="module")
def tiny_target():
    return make_ours(make_hf_model("llama_gqa", seed=0))


@pytest.fixture(scope="module")
def tiny_draft():
    # Another tiny model over the same vocabulary: a draft that is often wrong.
    return make_ours(make_hf_model("llama_gqa", seed=1))


def repeating_samples(model, n=6, length=24):
    """Training samples from the target's features: n sequences each repeating a
    random 5-token pattern (learnable from the features), answers from position 4."""
    from slipstream.spec.train_data import Samples, features_of_many
    g = torch.Generator().manual_seed(0)
    seqs = []
    for _ in range(n):
        base = torch.randint(0, 96, (5,), generator=g)
        seqs.append(base.repeat(length // 5 + 1)[:length])
    return Samples.pack(seqs, features_of_many(model, seqs, max_tokens_per_forward=40), [4] * n)


def draft_lm_head_over(table, vocab):
    """A DraftLMHead over the rows `vocab` of a target whose (tied) LM head holds the
    QuantMatrix `table`, without a model: what cpu_draft.quantize_head reads."""
    from slipstream.spec.heads import DraftLMHead

    class Owner:
        gguf_weight = table

    class Target:
        class lm_head:
            _owner = [Owner()]
    base = DraftLMHead.__new__(DraftLMHead)
    base.target, base.vocab, base.weight = Target(), vocab, None
    return base

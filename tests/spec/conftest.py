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

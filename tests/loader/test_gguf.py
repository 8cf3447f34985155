"""GGUF weights: dequantized, renamed to Hugging Face names, q/k un-permuted."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from slipstream.errors import ModelLoadError
from slipstream.loader import open_model

from tests.loader.checkpoints import Q, gguf_name, quantize, write_gguf

# Largest |ours - original| allowed, as a fraction of the tensor's largest |value|:
# about one quantization step of each format (half a step is the rounding error;
# a whole step leaves room for the rounding of the scales themselves).
TOLERANCE = {Q.F32: 0.0, Q.F16: 1e-3, Q.BF16: 8e-3, Q.Q8_0: 1 / 127, Q.Q6_K: 1 / 31,
             Q.Q4_0: 1 / 8, Q.Q4_1: 1 / 8}


@pytest.mark.parametrize("qtype", list(TOLERANCE), ids=lambda q: q.name)
def test_weights_round_trip(tmp_path, tiny_model, qtype):
    model = tiny_model("llama")
    files = open_model(write_gguf(tmp_path / "m.gguf", model, qtype))
    ours = dict(files.weights())
    original = model.state_dict()
    assert set(ours) == set(original)
    for name, ref in original.items():
        w = ours[name]
        assert w.shape == ref.shape, name
        if ref.ndim == 1 or qtype == Q.F32:
            assert torch.equal(w.float(), ref), name
            continue
        if qtype in (Q.F16, Q.BF16):
            assert w.dtype == {Q.F16: torch.float16, Q.BF16: torch.bfloat16}[qtype]
        err = (w.float() - ref).abs().max().item()
        assert err <= TOLERANCE[qtype] * ref.abs().max().item(), (name, err)


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q6_K], ids=lambda q: q.name)
def test_weights_equal_gguf_dequantize_unpermuted(tmp_path, tiny_model, qtype):
    """Bit-exact against gguf.quants.dequantize, once q/k rows are put back in HF order."""
    model = tiny_model("llama")
    files = open_model(write_gguf(tmp_path / "m.gguf", model, qtype))
    ours = dict(files.weights())
    heads = {"q_proj": model.config.num_attention_heads, "k_proj": model.config.num_key_value_heads}
    for name, ref in model.state_dict().items():
        if ref.ndim != 2:
            continue
        data = ref.numpy()
        proj = name.split(".")[-2]
        if proj in heads:   # llama.cpp's permute, then its inverse written independently here
            n = heads[proj]
            data = data.reshape(n, 2, -1, data.shape[1]).swapaxes(1, 2).reshape(data.shape)
        deq = gguf.quants.dequantize(quantize(data, qtype), qtype)
        if proj in heads:
            deq = deq.reshape(n, -1, 2, deq.shape[1]).swapaxes(1, 2).reshape(deq.shape)
        assert np.array_equal(ours[name].numpy(), deq), name


def test_config_from_metadata(tmp_path, tiny_model):
    model = tiny_model("llama")
    cfg = open_model(write_gguf(tmp_path / "m.gguf", model)).config
    hf = model.config
    assert cfg.architecture == "llama"
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (
        hf.vocab_size, hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 64)
    assert cfg.rms_norm_eps == 1e-5 and cfg.rope_theta == 10000.0
    assert cfg.max_position_embeddings == 256
    assert not cfg.tie_word_embeddings and not cfg.attention_bias
    assert cfg.bos_token_id == 0 and cfg.eos_token_ids == (2,)


def test_tied_embeddings_have_no_lm_head(tmp_path, tiny_model):
    files = open_model(write_gguf(tmp_path / "m.gguf", tiny_model("llama", tie=True), Q.Q8_0))
    assert files.config.tie_word_embeddings
    assert "lm_head.weight" not in dict(files.weights())


def test_qwen2_keeps_row_order_and_biases(tmp_path, tiny_model):
    """llama.cpp does not permute qwen2's q/k (it uses NEOX-style RoPE there)."""
    model = tiny_model("qwen2")
    files = open_model(write_gguf(tmp_path / "m.gguf", model, Q.F32, arch="qwen2"))
    assert files.config.architecture == "qwen2" and files.config.attention_bias
    ours = dict(files.weights())
    for name, ref in model.state_dict().items():
        assert torch.equal(ours[name], ref), name
    assert "model.layers.0.self_attn.q_proj.bias" in ours


def llama3_rope_freqs(factor: float) -> np.ndarray:
    """What llama.cpp stores for Llama 3 scaling: plain inverse frequencies over
    scaled ones, the latter from transformers' own llama3 RoPE code."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=131072,
                      rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": factor,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 8192})
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    plain = 1.0 / 10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    return (plain / scaled.double()).float().numpy()


def test_llama3_rope_scaling_from_rope_freqs(tmp_path, tiny_model):
    """Llama 3.x files carry their RoPE scaling only as the rope_freqs.weight factors."""
    freqs = {"rope_freqs.weight": llama3_rope_freqs(8.0)}
    files = open_model(write_gguf(tmp_path / "m.gguf", tiny_model("llama"), extra_tensors=freqs))
    rs = files.config.rope_scaling
    assert rs.rope_type == "llama3" and rs.factor == 8.0
    assert (rs.low_freq_factor, rs.high_freq_factor, rs.original_max_position_embeddings) == (1.0, 4.0, 8192)
    assert "rope_freqs.weight" not in dict(files.weights())


def test_unknown_rope_freqs_fail(tmp_path, tiny_model):
    freqs = llama3_rope_freqs(8.0)
    freqs[5] *= 1.5
    path = write_gguf(tmp_path / "m.gguf", tiny_model("llama"), extra_tensors={"rope_freqs.weight": freqs})
    with pytest.raises(ModelLoadError, match="rope_freqs.weight is not Llama 3 RoPE scaling"):
        open_model(path)


def test_gguf_names_cover_every_parameter(tiny_model):
    # the writer helper's mapping, checked against the loader's, name by name
    from slipstream.loader.gguf import hf_name
    for name in tiny_model("qwen2").state_dict():
        assert hf_name(gguf_name(name)) == name

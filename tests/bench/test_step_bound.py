"""Bytes a step must move for the built-in weight and cache formats."""
import dataclasses

import torch

from slipstream.analysis.flops import Workload, model_cost
from slipstream.analysis.presets import PRESETS
from slipstream.bench.step_bound import precisions_for


def _bytes(prec, spec):
    return model_cost(spec, Workload.decode(1, 128), prec).total().bytes


def test_quantized_weights_count_their_own_bytes():
    spec = PRESETS["llama-3-8b"]
    dense = _bytes(precisions_for(torch.bfloat16), spec)
    int4 = _bytes(precisions_for(torch.bfloat16, "rtn-int4"), spec)
    head8 = _bytes(precisions_for(torch.bfloat16, "rtn-int4-head8"), spec)
    head = 128256 * 4096
    assert 14e9 < dense < 17e9
    # int4 g128: 0.5 byte a weight plus 5 bytes (fp32 scale, uint8 zero) a group of 128
    layers = dense - 2 * head - 2 * 4096 * 128 * 129      # embedding row, head, KV: not weights
    assert abs((dense - int4) - layers * (1 - (0.5 + 5 / 128) / 2)) / layers < 0.02
    assert head8 < int4 < dense
    assert abs((int4 - head8) - head) / head < 0.01                # bf16 -> int8 head: 1 B a weight
    assert 4.0e9 < head8 < 4.5e9


def test_unmodelled_formats_give_none():
    assert precisions_for(torch.bfloat16, "gguf") is None     # no loaded model to read
    assert precisions_for(torch.bfloat16, "rtn-int3") is None
    assert precisions_for(torch.bfloat16, None, "kivi4") is None
    p = precisions_for(torch.bfloat16, None, "int8", head_dim=128)
    assert abs(p.kv.bytes_per_element - (1 + 4 / 128)) < 1e-9


def test_gguf_blocks_count_the_bytes_the_loaded_model_holds():
    """The default model keeps Q4_1 blocks in its layers (5 bits a weight) and a
    Q8_0 embedding that is also its LM head (8.5 bits)."""
    from slipstream import LLM
    from slipstream.analysis.model_spec import ModelSpec
    llm = LLM(device="cpu", max_model_len=256, kv_cache_memory=32 << 20)
    cfg, model = llm.engine.config, llm.engine.runner.model
    if cfg.quantization != "gguf":
        import pytest
        pytest.skip("the CPU kernels did not build here: the default model runs dense")
    p = precisions_for(cfg.dtype, "gguf", head_dim=64, model=model)
    assert p.weight.bytes_per_element == 5 / 8 and p.head.bytes_per_element == 8.5 / 8
    spec = ModelSpec.from_model_config(cfg.model_config)
    assert spec.tie_word_embeddings
    fp32 = _bytes(precisions_for(torch.float32), spec)
    blocks = _bytes(p, spec)
    head = spec.vocab_size * spec.hidden_size
    # the tied head reads its Q8_0 blocks, not fp32 activations' bytes
    as_act = _bytes(dataclasses.replace(p, head_when_tied=False), spec)
    assert abs((as_act - blocks) - head * (4 - 8.5 / 8)) / head < 1e-6
    assert 0.14 < blocks / fp32 < 0.22

"""Bytes a step must move for the built-in weight and cache formats."""
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
    assert precisions_for(torch.bfloat16, "gguf") is None
    assert precisions_for(torch.bfloat16, "rtn-int3") is None
    assert precisions_for(torch.bfloat16, None, "kivi4") is None
    p = precisions_for(torch.bfloat16, None, "int8", head_dim=128)
    assert abs(p.kv.bytes_per_element - (1 + 4 / 128)) < 1e-9

"""The analysis layer's model of tensor-parallel communication."""
import json

import pytest

from slipstream.analysis.cli import main
from slipstream.analysis.flops import Workload
from slipstream.analysis.hardware import get_hardware
from slipstream.analysis.model_spec import ModelSpec
from slipstream.analysis.presets import resolve_model
from slipstream.analysis.tensor_parallel import (all_gather_time, all_reduce_time, get_link,
                                                 tp_cost)


def test_llama3_8b_decode_communication_by_hand():
    spec, hw, link = resolve_model("llama-3-8b"), get_hardware("H200"), get_link("h200-nvlink-graph")
    c = tp_cost(spec, hw, link, 2, Workload.decode(1, 4096))
    assert c.bytes_per_layer_per_token == 2 * 4096 * 2          # two bf16 [1, 4096] all-reduces
    assert c.all_reduces == 2 * 32 + 1                          # + the embedding's
    per_call = 17.7e-6 + 2 * (2 - 1) / 2 * 4096 * 2 / 270e9     # ring: 2 (N-1)/N of the bytes
    gather = 17.7e-6 + 0.5 * 128256 * 4 / 270e9                 # fp32 logits of one row
    assert c.comm_time == pytest.approx(65 * per_call + gather + 17.7e-6, rel=1e-9)
    assert c.compute_time == pytest.approx(c.single_time / 2, rel=1e-9)
    assert c.step_time == pytest.approx(c.compute_time + c.comm_time)
    # About 1.2 ms of collectives against about 1.6 ms of weight reads per GPU:
    # far from the 2x the split of the weights alone would give.
    assert 1.0 < c.speedup < 1.6


def test_single_rank_has_no_communication():
    spec, hw = resolve_model("llama-3-8b"), get_hardware("H100")
    c = tp_cost(spec, hw, get_link(), 1, Workload.decode(8, 1024))
    assert c.comm_time == 0 and c.speedup == pytest.approx(1.0)
    assert all_reduce_time(1e6, 1, get_link()) == all_gather_time(1e6, 1, get_link()) == 0


def test_when_tp_pays():
    hw = get_hardware("H200")
    small = ModelSpec("small", hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
                      head_dim=64, intermediate_size=1536, vocab_size=49152)
    slow = get_link(bandwidth=32e9, latency=30e-6)
    # A 135M model reads its weights in ~0.06 ms: 61 calls of 30 us cost more than that.
    assert tp_cost(small, hw, slow, 2, Workload.decode(1, 512)).speedup < 1
    big = resolve_model("llama-2-70b")
    eight = resolve_model("llama-3-8b")
    link = get_link("h200-nvlink-graph")
    work = Workload.decode(1, 4096)
    assert tp_cost(big, hw, link, 2, work).speedup > tp_cost(eight, hw, link, 2, work).speedup > 1
    # Eager NCCL calls cost more than graph-captured ones.
    assert tp_cost(eight, hw, get_link("h200-nvlink"), 2, work).comm_time > \
        tp_cost(eight, hw, link, 2, work).comm_time


def test_bad_links_are_refused():
    with pytest.raises(ValueError, match="unknown link"):
        get_link("carrier-pigeon")
    with pytest.raises(ValueError, match="positive bandwidth"):
        get_link(bandwidth=0, latency=1e-6)


def test_cli_tp_form(capsys):
    assert main(["tp", "llama-3-8b", "--tp", "1", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    decode = data["decode B=1 L=4096"]
    assert [r["tp"] for r in decode] == [1, 2]
    assert decode[1]["all_reduce_bytes_per_layer_per_token"] == 16384
    assert main(["tp", "llama-3-8b", "--tp", "2"]) == 0
    assert "speedup" in capsys.readouterr().out

"""The analysis layer's estimate of a prefill -> decode KV hand-over."""
import json

import pytest

from slipstream.analysis.cli import main
from slipstream.analysis.flops import Precisions
from slipstream.analysis.hardware import get_hardware
from slipstream.analysis.kv_transfer import (get_p2p_link, kv_bytes_per_token, kv_transfer_cost,
                                             moved_tokens)
from slipstream.analysis.presets import resolve_model


def test_llama3_8b_4k_prompt_by_hand():
    spec, link = resolve_model("llama-3-8b"), get_p2p_link("h200-nvlink-p2p")
    assert kv_bytes_per_token(spec) == 32 * 2 * 8 * 128 * 2              # 128 KiB a token
    assert kv_bytes_per_token(spec, Precisions.parse(kv="fp8")) == 32 * 2 * 8 * 128
    tokens = moved_tokens(4096, 16)
    assert tokens == 4080                                                 # the last block stays
    c = kv_transfer_cost(spec, get_hardware("H200"), link, tokens)
    assert c.bytes == 4080 * 131072
    assert c.time == pytest.approx(27.7e-6 + 4080 * 131072 / 356e9, rel=1e-12)
    assert 1e-3 < c.time < 2e-3 and c.share_of_prefill < 0.05


def test_tensor_parallel_pairs_move_their_shards_at_once():
    """2 ranks a side: each pair moves 4 of the 8 KV heads, in parallel; 16 ranks: each
    holds one head (replicated on two ranks), so twice the bytes move in all."""
    spec, hw, link = resolve_model("llama-3-8b"), get_hardware("H200"), get_p2p_link()
    one = kv_transfer_cost(spec, hw, link, 4080)
    two = kv_transfer_cost(spec, hw, link, 4080, tp=2)
    assert two.bytes == one.bytes and two.tp == 2
    assert two.time == pytest.approx(27.7e-6 + one.bytes / 2 / 356e9, rel=1e-12)
    assert two.prefill_time == pytest.approx(one.prefill_time / 2, rel=1e-9)
    sixteen = kv_transfer_cost(spec, hw, link, 4080, tp=16)
    assert sixteen.bytes == 2 * one.bytes
    assert sixteen.time == pytest.approx(27.7e-6 + one.bytes / 8 / 356e9, rel=1e-12)
    with pytest.raises(ValueError, match="tensor-parallel size"):
        kv_transfer_cost(spec, hw, link, 4080, tp=0)


def test_moved_tokens_and_links_are_checked():
    assert moved_tokens(1, 16) == 0 and moved_tokens(17, 16) == 16 and moved_tokens(16, 16) == 0
    with pytest.raises(ValueError, match="at least 1"):
        moved_tokens(0, 16)
    with pytest.raises(ValueError, match="unknown link"):
        get_p2p_link("carrier-pigeon")
    custom = get_p2p_link(bandwidth=10e9, latency=1e-5)
    assert custom.bus_bandwidth == 10e9
    with pytest.raises(ValueError, match="tokens must be"):
        kv_transfer_cost(resolve_model("llama-3-8b"), get_hardware("H200"), custom, 0)


def test_cli_kv_transfer(capsys):
    assert main(["kv-transfer", "llama-3-8b", "--prompt", "4096", "--json",
                 "--link-bandwidth", "100", "--link-latency", "0"]) == 0
    row = json.loads(capsys.readouterr().out)["rows"][0]
    assert row["tokens"] == 4080 and row["time_s"] == pytest.approx(4080 * 131072 / 100e9)
    assert main(["kv-transfer", "llama-3-8b"]) == 0
    assert "transfer/prefill" in capsys.readouterr().out

"""`slipstream bench latency | throughput` on a tiny random model (dummy weights) on the CPU."""
from __future__ import annotations

import json
from dataclasses import fields

import pytest

from slipstream.bench.cli import ENGINE_OPTIONS, _NOT_FLAGS
from slipstream.bench.dataset import (OUTPUT_RANGE, PROMPT_RANGE, fixed_requests,
                                      sharegpt_like_requests)
from slipstream.cli import main

TINY = dict(architectures=["LlamaForCausalLM"], vocab_size=128, hidden_size=64,
            intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5)
ENGINE = ["--load-format", "dummy", "--device", "cpu", "--dtype", "float32",
          "--num-kv-blocks", "512", "--block-size", "4"]


@pytest.fixture
def tiny(tmp_path):
    folder = tmp_path / "tiny"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY))
    return folder


def test_engine_options_cover_engine_args():
    from slipstream.engine.args import EngineArgs
    names = {f.name for f in fields(EngineArgs)} - _NOT_FLAGS
    assert names == set(ENGINE_OPTIONS), "bench/cli.py ENGINE_OPTIONS must list every EngineArgs field"
    defaults = {f.name: f.default for f in fields(EngineArgs)}
    for name, (_, default, _) in ENGINE_OPTIONS.items():
        assert default == defaults[name], name


def test_latency(tiny, tmp_path, capsys):
    out = tmp_path / "lat.json"
    rc = main(["bench", "latency", "--model", str(tiny), *ENGINE, "--batch-size", "3",
               "--input-len", "20", "--output-len", "6", "--num-iters", "2",
               "--num-iters-warmup", "1", "--quantization", "none", "--output-json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["batch_size"] == 3 and len(res["latency_per_iter_s"]) == 2
    assert res["prefill_s"] > 0 and res["decode_step_s"] > 0
    assert res["decode_tokens_per_s"] == pytest.approx(3 / res["decode_step_s"])
    # weights (fp32) at least: 2 layers of qkv/o/gate_up/down + embedding + head
    assert res["decode_step_bytes"] > 4 * 2 * (64 * 128 + 64 * 64 + 3 * 64 * 96)
    assert res["decode_pct_copy_bandwidth"] is None     # CPU: no copy-bandwidth share
    printed = capsys.readouterr().out
    assert "prefill:" in printed and "decode:" in printed and "tokens/s" in printed


@pytest.mark.parametrize("lengths", [[], ["--input-len", "12", "--output-len", "5"]])
def test_throughput(tiny, tmp_path, capsys, lengths):
    out = tmp_path / "thr.json"
    rc = main(["bench", "throughput", "--model", str(tiny), *ENGINE, "--num-prompts", "6",
               "--max-num-seqs", "4", "--max-model-len", "96", *lengths, "--output-json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    if lengths:
        assert res["dataset"] == "random" and res["output_tokens"] == 6 * 5
    else:
        assert res["dataset"] == "sharegpt-like"
    for key in ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s"):
        assert res[key] > 0
    b = res["batch_sizes"]
    assert b["decode_steps"] > 0 and 1 <= b["decode_batch_max"] <= 4
    assert sum(b["decode_batch_histogram"].values()) == b["decode_steps"]
    r = res["roofline"]
    assert 0 < r["bound_s"] and r["pct_of_bound"] == pytest.approx(100 * r["bound_s"] / res["elapsed_s"])
    printed = capsys.readouterr().out
    assert "requests/s" in printed and "roofline bound" in printed


def test_bad_options(tiny, capsys):
    assert main(["bench", "latency", "--model", str(tiny), *ENGINE, "--batch-size", "0"]) == 2
    assert "--batch-size" in capsys.readouterr().err
    assert main(["bench", "throughput", "--model", str(tiny), *ENGINE, "--dataset", "random"]) == 2
    assert "--input-len" in capsys.readouterr().err


def test_datasets_are_seeded_and_in_range():
    a = sharegpt_like_requests(300, 1000, 4096, seed=3)
    b = sharegpt_like_requests(300, 1000, 4096, seed=3)
    assert a == b and a != sharegpt_like_requests(300, 1000, 4096, seed=4)
    p = [len(r.prompt_token_ids) for r in a]
    o = [r.output_len for r in a]
    assert PROMPT_RANGE[0] <= min(p) and max(p) <= PROMPT_RANGE[1]
    assert OUTPUT_RANGE[0] <= min(o) and max(o) <= OUTPUT_RANGE[1]
    # skewed: a long tail above the median
    assert sorted(p)[150] < sum(p) / len(p) and max(p) > 3 * sorted(p)[150]
    short = sharegpt_like_requests(50, 1000, 64, seed=0)
    assert all(len(r.prompt_token_ids) + r.output_len <= 64 for r in short)
    with pytest.raises(ValueError, match="exceeds"):
        fixed_requests(2, 60, 10, 1000, 64)

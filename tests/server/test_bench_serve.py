"""`slipstream bench serve` against a served tiny model: every request completes with its
drawn length, the report holds the percentiles, and the draw is fixed by the seed."""
from __future__ import annotations

import json

from slipstream.bench.serve import INPUT_MEDIAN, _pct, make_samples
from slipstream.cli import main


def test_samples_are_seeded_and_sharegpt_shaped():
    a = make_samples(400, 32000, 2048, 1024, 4, seed=0)
    assert a == make_samples(400, 32000, 2048, 1024, 4, seed=0)
    assert a != make_samples(400, 32000, 2048, 1024, 4, seed=1)
    lens = sorted(len(s.prompt_ids) for s in a)
    assert 0.7 * INPUT_MEDIAN < lens[200] < 1.3 * INPUT_MEDIAN   # median near the law's
    assert lens[-1] > 3 * lens[200]                               # a long tail
    assert all(3200 <= t < 28800 for s in a for t in s.prompt_ids)
    other = make_samples(400, 32000, 2048, 1024, 4, seed=0, ids_seed=1)   # next rate's run
    assert [len(s.prompt_ids) for s in other] == [len(s.prompt_ids) for s in a]
    assert [s.output_len for s in other] == [s.output_len for s in a]
    assert all(x.prompt_ids != y.prompt_ids for x, y in zip(a, other))


def test_percentiles():
    assert _pct([1, 2, 3, 4, 5], 50) == 3
    assert _pct([0, 10], 90) == 9


def test_bench_serve_runs(tiny_server, tmp_path):
    rc = main(["bench", "serve", "--base-url", tiny_server.url, "--num-requests", "12",
               "--request-rate", "20,inf", "--warmup", "4", "--max-input-len", "64", "--max-output-len", "16",
               "--out", str(tmp_path), "--label", "t"])
    assert rc == 0
    report = json.loads((tmp_path / "t.json").read_text())
    assert [r["request_rate"] for r in report["runs"]] == [20.0, float("inf")]
    for r in report["runs"]:
        assert r["completed"] == 12 and r["failed"] == 0
        assert r["ttft_ms"]["p50"] <= r["ttft_ms"]["p99"] <= r["e2e_ms"]["p99"]
        assert r["output_token_throughput"] > 0 and r["goodput"] <= r["request_throughput"]
    assert "| rate (req/s) |" in (tmp_path / "t.md").read_text()

"""`slipstream serve` hands every engine option to the engine, speculation included."""
import pytest

from slipstream.cli import build_parser
from slipstream.server.cli import make_engine


def test_speculative_options_reach_the_engine(tiny_model_dir):
    args = build_parser("serve").parse_args(
        ["serve", "--model", str(tiny_model_dir), "--device", "cpu", "--speculative-method", "ngram",
         "--num-speculative-tokens", "3", "--max-model-len", "128"])
    engine = make_engine(args)
    spec = engine.config.speculative
    assert spec.method == "ngram" and spec.num_speculative_tokens == 3
    assert engine.runner.speculator is not None


def test_a_bad_speculative_option_names_its_flag(tiny_model_dir, capsys):
    serve = ["serve", "--model", str(tiny_model_dir), "--device", "cpu", "--speculative-method", "ngram"]
    with pytest.raises(SystemExit):     # a number out of range: refused by the parser
        build_parser("serve").parse_args(serve + ["--num-speculative-tokens", "99"])
    assert "argument --num-speculative-tokens: must be in [1, 16], got 99" in capsys.readouterr().err
    args = build_parser("serve").parse_args(serve + ["--spec-tree", "4,4,16"])
    with pytest.raises(ValueError, match="--spec-tree '4,4,16': medusa takes"):
        make_engine(args)


def _sse(url: str, body: dict) -> list[dict]:
    import json
    import urllib.request
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    events = []
    with urllib.request.urlopen(req, timeout=60) as r:
        for line in r:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def test_logprobs_and_penalties_under_speculation_over_http(tmp_path, tiny_model_dir, tiny_server):
    """A server that speculates answers with the tokens and log-probabilities of one
    that does not, streamed (several tokens a chunk) and whole, penalties included."""
    from tests.server.conftest import TINY_ARGS, ServerProcess
    spec = ServerProcess(["--model", str(tiny_model_dir), *TINY_ARGS, "--speculative-method", "ngram",
                          "--num-speculative-tokens", "3", "--no-spec-auto-off"], tmp_path / "spec.log")
    try:
        for extra in ({}, {"frequency_penalty": 0.4, "repetition_penalty": 1.2}):
            body = {"prompt": [5, 6, 7, 8, 9] * 4, "max_tokens": 20, "temperature": 0,
                    "ignore_eos": True, "logprobs": 2, **extra}
            status, plain = tiny_server.post("/v1/completions", body)
            assert status == 200, plain
            status, whole = spec.post("/v1/completions", body)
            assert status == 200, whole
            a, b = plain["choices"][0]["logprobs"], whole["choices"][0]["logprobs"]
            assert whole["choices"][0]["text"] == plain["choices"][0]["text"]
            assert b["tokens"] == a["tokens"] and len(b["tokens"]) == 20
            assert b["token_logprobs"] == pytest.approx(a["token_logprobs"], abs=1e-4)
            assert [sorted(t) for t in b["top_logprobs"]] == [sorted(t) for t in a["top_logprobs"]]
            events = _sse(spec.url + "/v1/completions", {**body, "stream": True})
            chunks = [e["choices"][0] for e in events if e.get("choices")]
            assert "".join(c["text"] for c in chunks) == whole["choices"][0]["text"]
            streamed = [t for c in chunks if c["logprobs"] for t in c["logprobs"]["token_logprobs"]]
            assert streamed == pytest.approx(b["token_logprobs"], abs=1e-4)
        assert spec.metrics()["slipstream_spec_accepted_tokens_total"] > 0
    finally:
        spec.stop()

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


def test_a_bad_speculative_option_names_its_flag(tiny_model_dir):
    args = build_parser("serve").parse_args(
        ["serve", "--model", str(tiny_model_dir), "--device", "cpu", "--speculative-method", "ngram",
         "--num-speculative-tokens", "99"])
    with pytest.raises(ValueError, match="--num-speculative-tokens must be in"):
        make_engine(args)

import math

import pytest

from slipstream.eval.perplexity import perplexity, sliding_windows
from tests.quant.conftest import make_llm, prompt_logprobs, random_prompts


@pytest.mark.parametrize("n,context,stride", [(10, 4, 2), (10, 4, 4), (3, 4, 2), (11, 5, 1),
                                              (50, 16, 5)])
def test_windows_score_each_token_once(n, context, stride):
    wins = sliding_windows(n, context, stride)
    scored = [j for s, e, first in wins for j in range(first, e)]
    assert len(scored) == len(set(scored)) and max(scored) == n - 1
    assert all(e - s <= context and s < first for s, e, first in wins)
    if stride < context:
        assert scored == list(range(1, n))     # overlapping windows leave no gap


def test_one_window_perplexity_is_the_mean_prompt_logprob(tiny_llama):
    llm = make_llm(tiny_llama)
    ids = random_prompts(1, 40)[0]["prompt_token_ids"]
    r = perplexity(llm, ids, context=64)
    lp = prompt_logprobs(llm, [{"prompt_token_ids": ids}])
    assert r.tokens == 39 and r.windows == 1
    assert r.ppl == pytest.approx(math.exp(-lp.mean().item()), rel=1e-5)
    # Shorter windows see less context: a different, still finite figure over the same tokens.
    r2 = perplexity(llm, ids, context=8, stride=4)
    assert r2.tokens == 39 and math.isfinite(r2.ppl)
    for bad in (9, 0):
        with pytest.raises(ValueError, match="stride"):
            perplexity(llm, ids, context=8, stride=bad)


def test_cli_eval_ppl(tiny_llama, tmp_path, capsys):
    from slipstream.cli import main
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 4)
    assert main(["eval", "ppl", str(tiny_llama), "--text", str(text), "--context", "32",
                 "--dtype", "float32", "--device", "cpu", "--json"]) == 0
    out = capsys.readouterr().out
    assert '"ppl"' in out and '"stride": 16' in out
    assert main(["eval", "ppl", str(tiny_llama), "--text", str(tmp_path / "none.txt")]) == 2


@pytest.mark.parametrize("opts,message", [(["--context", "0"], "--context: expected at least 2"),
                                          (["--context", "8", "--stride", "9"], "--stride: expected 1..")])
def test_cli_eval_ppl_refuses_bad_windows_by_their_option_names(tmp_path, capsys, opts, message):
    """Checked before any model loads, named as the user spelled them."""
    from slipstream.cli import main
    text = tmp_path / "t.txt"
    text.write_text("some text")
    assert main(["eval", "ppl", "/nonexistent/model", "--text", str(text), *opts]) == 2
    assert message in capsys.readouterr().err

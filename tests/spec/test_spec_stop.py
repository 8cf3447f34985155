"""Stop strings inside a step that accepts several draft tokens: the answer ends
where plain decoding ends it (text, token ids, min_tokens counted per token)."""
import pytest

from slipstream import LLM, SamplingParams

COUNTING = ("one two three four five six seven eight nine ten one two three four five six seven "
            "eight nine ten one two three four five six seven eight nine ten one two")


@pytest.fixture(scope="module")
def engines():
    kw = dict(device="cpu", max_model_len=256, seed=0, kv_cache_memory=32 << 20,
              enable_prefix_caching=False)
    return LLM(**kw), LLM(**kw, speculative_method="ngram", num_speculative_tokens=4,
                          speculative_auto_off=False)


@pytest.mark.parametrize("stop, include, min_tokens", [
    (["five"], False, 0), (["seven"], True, 0), (["six"], False, 0),
    (["four"], False, 6),     # the first "four" comes before min_tokens: the second one stops
])
def test_spec_stops_where_plain_decoding_stops(engines, stop, include, min_tokens):
    plain, spec = engines
    params = SamplingParams(temperature=0, max_tokens=24, stop=stop, min_tokens=min_tokens,
                            include_stop_str_in_output=include)
    want = plain.generate(COUNTING, params, use_tqdm=False)[0].outputs[0]
    got = spec.generate(COUNTING, params, use_tqdm=False)[0].outputs[0]
    assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == \
        (want.text, want.token_ids, want.finish_reason, want.stop_reason)
    assert got.finish_reason == "stop"
    assert spec.engine.spec_stats.accepted > 0       # several tokens a step did happen

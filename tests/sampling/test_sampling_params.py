import math

import pytest

from slipstream.sampling_params import SamplingParams


@pytest.mark.parametrize("field, value", [
    ("n", 0),
    ("n", -3),
    ("n", 1.5),
    ("temperature", -0.1),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", "hot"),
    ("top_p", 0.0),
    ("top_p", -0.5),
    ("top_p", 1.01),
    ("top_k", -2),
    ("top_k", 2.5),
    ("min_p", -0.01),
    ("min_p", 1.5),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", math.inf),
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.01),
    ("frequency_penalty", 3.0),
    ("frequency_penalty", -7.0),
    ("seed", 1.5),
    ("seed", 2 ** 64),
    ("stop", ""),
    ("stop", ["ok", ""]),
    ("stop", ["ok", 3]),
    ("stop", 42),
    ("stop_token_ids", [1, -1]),
    ("stop_token_ids", [1, "2"]),
    ("stop_token_ids", 7),
    ("max_tokens", 0),
    ("max_tokens", -1),
    ("max_tokens", 2.0),
    ("min_tokens", -1),
    ("logprobs", -2),
    ("logprobs", 1.5),
    ("logprobs", "5"),
    ("prompt_logprobs", -5),
    ("prompt_logprobs", 0.5),
])
def test_invalid_values_raise_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^{field} "):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_names_min_tokens():
    with pytest.raises(ValueError, match=r"^min_tokens .*max_tokens=4"):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert SamplingParams(max_tokens=None, min_tokens=500).min_tokens == 500


def test_defaults_follow_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert p.max_tokens == 16 and p.min_tokens == 0 and p.seed is None
    assert p.stop == [] and p.stop_token_ids == []
    assert p.logprobs is None and p.prompt_logprobs is None
    assert p.skip_special_tokens and not p.include_stop_str_in_output and not p.ignore_eos
    assert not p.is_greedy and not p.has_penalties


def test_normalisation():
    p = SamplingParams(stop="###", stop_token_ids=(5, 3, 5), top_k=-1, seed=-1,
                       logprobs=True, prompt_logprobs=False, max_tokens=None)
    assert p.stop == ["###"]
    assert p.stop_token_ids == [5, 3]
    assert p.top_k == 0 and p.seed is None
    assert p.logprobs == 1 and p.prompt_logprobs is None
    assert p.max_tokens is None
    assert SamplingParams(stop=("a", "bc")).stop == ["a", "bc"]
    assert SamplingParams(logprobs=-1, prompt_logprobs=0).logprobs == -1


def test_greedy_clears_filters():
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=7, min_p=0.2)
    assert p.is_greedy
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)
    assert SamplingParams(temperature=9e-6).is_greedy
    assert not SamplingParams(temperature=1e-5).is_greedy
    # Validation runs before greedy normalisation: a bad top_p is still an error.
    with pytest.raises(ValueError, match="^top_p"):
        SamplingParams(temperature=0.0, top_p=0.0)


def test_has_penalties():
    assert SamplingParams(repetition_penalty=1.1).has_penalties
    assert SamplingParams(presence_penalty=-0.5).has_penalties
    assert SamplingParams(frequency_penalty=0.5).has_penalties


def test_output_text_buffer_length():
    assert SamplingParams(stop=["ab", "cdef"]).output_text_buffer_length == 3
    assert SamplingParams(stop=["ab"], include_stop_str_in_output=True) \
        .output_text_buffer_length == 0
    assert SamplingParams().output_text_buffer_length == 0


def test_child_fans_out_with_seed_plus_index():
    parent = SamplingParams(n=4, seed=100, temperature=0.7, stop=["x"], logprobs=2)
    children = [parent.child(i) for i in range(parent.n)]
    assert [c.seed for c in children] == [100, 101, 102, 103]
    assert all(c.n == 1 for c in children)
    assert all((c.temperature, c.stop, c.logprobs) == (0.7, ["x"], 2) for c in children)
    assert parent.n == 4 and parent.seed == 100  # the parent is untouched
    unseeded = SamplingParams(n=3).child(2)
    assert unseeded.n == 1 and unseeded.seed is None

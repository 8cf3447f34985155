"""The official `openai` client against `slipstream serve` (default model) on 127.0.0.1."""
from __future__ import annotations

import json
import math

import pytest

import slipstream

openai = pytest.importorskip("openai")


def test_models_and_health(default_server, client, model):
    assert model.startswith("SmolLM2")
    assert client.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    assert json.loads(default_server.get("/version")) == {"version": slipstream.__version__}
    assert default_server.get("/health") == '{"status":"ok"}'


def test_completion_greedy_stream_matches_whole(client, model):
    kw = dict(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
    whole = client.completions.create(**kw)
    assert whole.object == "text_completion"
    assert "Paris" in whole.choices[0].text
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 8 and whole.usage.prompt_tokens > 0
    chunks = list(client.completions.create(**kw, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_stream_matches_whole(client, model):
    kw = dict(model=model, messages=[{"role": "user", "content": "What is the capital of France?"}],
              max_tokens=12, temperature=0)
    whole = client.chat.completions.create(**kw)
    msg = whole.choices[0].message
    assert whole.object == "chat.completion" and msg.role == "assistant"
    assert "Paris" in msg.content
    stream = client.chat.completions.create(**kw, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == msg.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_max_completion_tokens_and_ignore_eos(client, model):
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                       max_completion_tokens=5, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"


def test_n_samples_seeded(client, model):
    kw = dict(model=model, prompt="Once upon a time", max_tokens=6, n=3, temperature=1.0, seed=7,
              extra_body={"ignore_eos": True})
    a = client.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert a.usage.completion_tokens == 18
    assert len({c.text for c in a.choices}) > 1        # siblings differ (seed + index)
    b = client.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # and repeat
    s = client.completions.create(**kw, stream=True)
    texts = {}
    for c in s:
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
    assert [texts[i] for i in range(3)] == [c.text for c in a.choices]


def test_batch_prompts(client, model):
    r = client.completions.create(model=model, prompt=["Hello", "The sky is"], max_tokens=3, n=2,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text    # greedy: both samples of prompt 0 agree


def test_completion_logprobs(client, model):
    r = client.completions.create(model=model, prompt="1, 2, 3,", max_tokens=5, temperature=0,
                                  logprobs=3, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    for chosen, tops in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(tops) == 3 and chosen <= 0
        assert math.isclose(chosen, max(tops.values()), abs_tol=1e-4)  # greedy takes the top


def test_sampled_token_is_always_among_the_completion_top_logprobs(client, model):
    r = client.completions.create(model=model, prompt="Once upon a time", max_tokens=12,
                                  temperature=1.0, seed=3, logprobs=1,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    for tok, chosen, tops in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert tops[tok] == chosen and len(tops) <= 2      # logprobs + 1 at most
    zero = client.completions.create(model=model, prompt="Once upon a time", max_tokens=3,
                                     temperature=0, logprobs=0).choices[0].logprobs
    assert [list(t) for t in zero.top_logprobs] == [[t] for t in zero.tokens]


def test_echo_with_logprobs_scores_the_prompt(client, model):
    """lm-eval-harness's log-likelihood request: echo, logprobs, one token."""
    prompt = "The capital of France is"
    kw = dict(model=model, prompt=prompt, max_tokens=2, temperature=0, logprobs=1, echo=True,
              extra_body={"ignore_eos": True})
    r = client.completions.create(**kw)
    lp, n_prompt = r.choices[0].logprobs, r.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + 2 == len(lp.token_logprobs) == len(lp.text_offset)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    text = r.choices[0].text
    assert "".join(lp.tokens) == text
    assert [text[o:o + len(t)] for o, t in zip(lp.text_offset, lp.tokens)] == lp.tokens
    chunks = list(client.completions.create(**kw, stream=True))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert sum((s.text_offset for s in streamed), []) == lp.text_offset
    assert sum((s.tokens for s in streamed), []) == lp.tokens


def test_chat_logprobs(client, model):
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hello"}], max_tokens=4,
        temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 2
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        assert math.isclose(t.logprob, t.top_logprobs[0].logprob, abs_tol=1e-4)
    chunks = list(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hello"}], max_tokens=4,
        temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True}, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]


def test_stop_strings(client, model):
    kw = dict(model=model, prompt="The capital of France is", max_tokens=16, temperature=0)
    full = client.completions.create(**kw).choices[0].text
    assert "Paris" in full
    cut = full.index("Paris") + 2          # stop in the middle of a word
    stop = full[cut:cut + 3]
    r = client.completions.create(**kw, stop=[stop, "never-seen"])
    assert r.choices[0].text == full[:full.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stop=stop,
                                                                              stream=True))
    assert streamed == r.choices[0].text
    kept = client.completions.create(**kw, stop=stop, extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == full[:full.index(stop) + len(stop)]


def test_penalties_and_extras_accepted(client, model):
    r = client.completions.create(
        model=model, prompt="a a a a", max_tokens=4, temperature=0.8, top_p=0.9, seed=1,
        presence_penalty=0.5, frequency_penalty=0.5,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.2, "ignore_eos": True})
    assert r.usage.completion_tokens == 4


def test_logit_bias_steers_the_tokens(default_server, client, model):
    """+100 on one token makes greedy decoding pick it every step; -100 on the token
    greedy decoding picks first makes it pick another."""
    _, tok = default_server.post("/tokenize", {"prompt": " Paris", "add_special_tokens": False})
    paris = tok["tokens"][0]
    r = client.completions.create(model=model, prompt="The capital of France is", max_tokens=3,
                                  temperature=0, logit_bias={str(paris): 100})
    _, ids = default_server.post("/tokenize", {"prompt": r.choices[0].text,
                                               "add_special_tokens": False})
    assert ids["tokens"] == [paris] * 3
    plain = client.completions.create(model=model, prompt="The capital of France is",
                                      max_tokens=1, temperature=0, logprobs=1)
    first = plain.choices[0].logprobs.tokens[0]
    _, first_ids = default_server.post("/tokenize", {"prompt": first, "add_special_tokens": False})
    banned = client.completions.create(model=model, prompt="The capital of France is", max_tokens=1,
                                       temperature=0, logprobs=1,
                                       logit_bias={str(first_ids["tokens"][0]): -100})
    assert banned.choices[0].logprobs.tokens[0] != first


def test_openai_error_objects(client, model):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="x", max_tokens=-1)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError) as e:   # 404, as the OpenAI API answers
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    assert e.value.body["param"] == "model" and e.value.body["code"] == "model_not_found"


def test_metrics(default_server, client, model):
    client.completions.create(model=model, prompt="The capital of France is", max_tokens=2)
    m = default_server.metrics()
    assert m["slipstream_generation_tokens_total"] > 0
    assert m["slipstream_time_to_first_token_seconds_count"] > 0
    assert m["slipstream_inter_token_latency_seconds_count"] > 0
    assert m["slipstream_prefix_cache_hit_tokens_total"] > 0   # the prompt repeats
    assert 0 < m["slipstream_prefix_cache_hit_rate"] <= 1
    for name in ("slipstream_requests_waiting", "slipstream_requests_running",
                 "slipstream_kv_cache_usage", "slipstream_generation_tokens_per_second",
                 "slipstream_spec_acceptance_rate"):
        assert name in m


def test_echo_and_token_id_prompts(client, model):
    r = client.completions.create(model=model, prompt="The capital of France is", max_tokens=4,
                                  temperature=0, echo=True)
    assert r.choices[0].text.startswith("The capital of France is")
    plain = client.completions.create(model=model, prompt="The capital of France is",
                                      max_tokens=4, temperature=0).choices[0].text
    assert r.choices[0].text == "The capital of France is" + plain
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=4, temperature=0, echo=True,
        stream=True))
    assert streamed == r.choices[0].text
    ids = client.completions.create(model=model, prompt=[[504, 3575, 282], [504, 3575]],
                                    max_tokens=2, temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in ids.choices] == [0, 1] and ids.usage.prompt_tokens == 5


def test_echo_with_max_tokens_zero_scores_the_prompt_alone(client, model):
    """lm-eval-harness's scoring request: echo, logprobs and max_tokens 0 answer the
    prompt and its log-probabilities, nothing generated, whole and streamed; the
    prompt's log-probabilities equal those of a request that also generates."""
    prompt = "The capital of France is"
    kw = dict(model=model, prompt=prompt, max_tokens=0, temperature=0, logprobs=1, echo=True)
    r = client.completions.create(**kw)
    c, n_prompt = r.choices[0], r.usage.prompt_tokens
    assert c.text == prompt and c.finish_reason == "length"
    assert r.usage.completion_tokens == 0 and r.usage.total_tokens == n_prompt
    assert len(c.logprobs.tokens) == n_prompt == len(c.logprobs.token_logprobs)
    assert "".join(c.logprobs.tokens) == prompt and c.logprobs.token_logprobs[0] is None
    full = client.completions.create(**{**kw, "max_tokens": 2}).choices[0].logprobs
    assert c.logprobs.token_logprobs[1:] == pytest.approx(full.token_logprobs[1:n_prompt], abs=1e-5)
    chunks = list(client.completions.create(**kw, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == prompt
    streamed = [ch.choices[0].logprobs for ch in chunks if ch.choices and ch.choices[0].logprobs]
    assert sum((s.tokens for s in streamed), []) == c.logprobs.tokens
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    plain = list(client.completions.create(model=model, prompt=prompt, max_tokens=0, echo=True,
                                           stream=True))
    assert "".join(ch.choices[0].text for ch in plain if ch.choices) == prompt
    with pytest.raises(Exception) as e:        # without echo, 0 tokens is an error
        client.completions.create(model=model, prompt=prompt, max_tokens=0)
    assert "max_tokens" in str(e.value)

"""Bad requests answer 4xx with an OpenAI error object naming the field, never a 500;
the server serves a good request afterwards."""
from __future__ import annotations

import json

import pytest

C, CH = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]


def comp(**kw):
    return {"prompt": "hello", "max_tokens": 2, **kw}


def chat(**kw):
    return {"messages": MSG, "max_tokens": 2, **kw}


# (id, path, body (dict or raw bytes), expected status, expected error.param or None)
CASES = [
    ("malformed-json", C, b'{"prompt": "x", ', 400, None),
    ("body-not-object", C, b"[1, 2, 3]", 400, None),
    ("empty-body", C, b"", 400, None),
    ("not-utf8", C, b'{"prompt": "\xff\xfe"}', 400, None),
    ("missing-prompt", C, {"max_tokens": 2}, 400, "prompt"),
    ("prompt-number", C, comp(prompt=123), 400, "prompt"),
    ("prompt-empty-string", C, comp(prompt=""), 400, "prompt"),
    ("prompt-empty-list", C, comp(prompt=[]), 400, "prompt"),
    ("prompt-id-out-of-vocab", C, comp(prompt=[5, 99999]), 400, "prompt"),
    ("prompt-negative-id", C, comp(prompt=[-1]), 400, "prompt"),
    ("prompt-too-long", C, comp(prompt="ab " * 1000), 400, "prompt"),
    ("max-tokens-negative", C, comp(max_tokens=-5), 400, "max_tokens"),
    ("max-tokens-zero", C, comp(max_tokens=0), 400, "max_tokens"),
    ("max-tokens-too-large", C, comp(max_tokens=10 ** 6), 400, "max_tokens"),
    ("max-tokens-string", C, comp(max_tokens="10"), 400, "max_tokens"),
    ("max-tokens-float", C, comp(max_tokens=2.5), 400, "max_tokens"),
    ("temperature-negative", C, comp(temperature=-1), 400, "temperature"),
    ("temperature-string", C, comp(temperature="0.5"), 400, "temperature"),
    # more sequences than the server ever holds (64 running + 1,024 queued): 400, not a 503
    ("more-sequences-than-the-server-holds", C, comp(prompt=["hi"] * 69, n=16), 400, "n"),
    ("temperature-too-high", C, comp(temperature=3), 400, "temperature"),
    ("temperature-string", C, comp(temperature="hot"), 400, "temperature"),
    ("temperature-nan", C, b'{"prompt": "x", "temperature": NaN}', 400, "temperature"),
    ("top-p-zero", C, comp(top_p=0), 400, "top_p"),
    ("top-p-above-one", C, comp(top_p=1.5), 400, "top_p"),
    ("n-zero", C, comp(n=0), 400, "n"),
    ("n-too-large", C, comp(n=1000), 400, "n"),
    ("logprobs-too-many", C, comp(logprobs=10), 400, "logprobs"),
    ("logprobs-negative", C, comp(logprobs=-1), 400, "logprobs"),
    ("presence-penalty", C, comp(presence_penalty=5), 400, "presence_penalty"),
    ("frequency-penalty", C, comp(frequency_penalty=-3), 400, "frequency_penalty"),
    ("seed-string", C, comp(seed="abc"), 400, "seed"),
    ("stream-string", C, comp(stream="yes"), 400, "stream"),
    ("stream-options-no-stream", C, comp(stream_options={"include_usage": True}), 400,
     "stream_options"),
    ("stop-number", C, comp(stop=5), 400, "stop"),
    ("stop-empty-string", C, comp(stop=[""]), 400, "stop"),
    ("stop-too-many", C, comp(stop=[f"s{i}" for i in range(20)]), 400, "stop"),
    ("logit-bias-bad-key", C, comp(logit_bias={"abc": 1}), 400, "logit_bias"),
    ("logit-bias-out-of-vocab", C, comp(logit_bias={"99999": 1}), 400, "logit_bias"),
    ("logit-bias-value", C, comp(logit_bias={"5": 500}), 400, "logit_bias"),
    ("top-k-negative", C, comp(top_k=-5), 400, "top_k"),
    ("min-p-above-one", C, comp(min_p=2), 400, "min_p"),
    ("repetition-penalty-zero", C, comp(repetition_penalty=0), 400, "repetition_penalty"),
    ("min-tokens-above-max", C, comp(min_tokens=10, max_tokens=2), 400, "min_tokens"),
    ("stop-token-ids-out-of-vocab", C, comp(stop_token_ids=[99999]), 400, "stop_token_ids"),
    ("best-of-above-n", C, comp(best_of=3), 400, "best_of"),
    ("suffix", C, comp(suffix="end"), 400, "suffix"),
    ("json-mode", CH, chat(response_format={"type": "json_object"}), 400, "response_format"),
    ("tools-auto", CH, chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools"),
    ("functions", CH, chat(functions=[{"name": "f"}]), 400, "functions"),
    ("unknown-model", C, comp(model="gpt-9"), 404, "model"),
    ("chat-unknown-model", CH, chat(model="gpt-9"), 404, "model"),
    ("chat-missing-messages", CH, {"max_tokens": 2}, 400, "messages"),
    ("chat-empty-messages", CH, chat(messages=[]), 400, "messages"),
    ("chat-messages-not-list", CH, chat(messages="hi"), 400, "messages"),
    ("chat-bad-role", CH, chat(messages=[{"role": "wizard", "content": "x"}]), 400,
     "messages.0.role"),
    ("chat-missing-role", CH, chat(messages=[{"content": "x"}]), 400, "messages.0.role"),
    ("chat-content-number", CH, chat(messages=[{"role": "user", "content": 5}]), 400,
     "messages.0.content"),
    ("chat-too-long", CH, chat(messages=[{"role": "user", "content": "ab " * 1000}]), 400,
     "messages"),
    ("chat-max-completion-tokens-too-large", CH, chat(max_completion_tokens=5000), 400,
     "max_completion_tokens"),
    ("chat-top-logprobs-too-many", CH, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("chat-top-logprobs-without-logprobs", CH, chat(top_logprobs=2), 400, "top_logprobs"),
    ("chat-logprobs-int", CH, chat(logprobs=3), 400, "logprobs"),
    ("chat-tool-choice-without-tools", CH, chat(tool_choice="required"), 400, "tool_choice"),
    ("chat-image-part", CH, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]), 400, "messages.0.content"),
    ("guided-choice", CH, chat(guided_choice=["yes", "no"]), 400, "guided_choice"),
    ("guided-json", C, comp(guided_json={"type": "object"}), 400, "guided_json"),
    ("structured-outputs", CH, chat(structured_outputs={"choice": ["a"]}), 400,
     "structured_outputs"),
    ("beam-search", C, comp(use_beam_search=True), 400, "use_beam_search"),
    ("truncate-prompt-tokens", C, comp(truncate_prompt_tokens=4), 400, "truncate_prompt_tokens"),
    ("chat-template-kwargs", CH, chat(chat_template_kwargs={"enable_thinking": True}), 400,
     "chat_template_kwargs"),
    ("chat-echo", CH, chat(echo=True), 400, "echo"),
    ("n-null-is-fine-but-max-tokens-string", C, comp(n=None, max_tokens="x"), 400, "max_tokens"),
    # JSON may spell a lone UTF-16 surrogate, which no tokenizer encodes (json.dumps
    # writes it as \ud800) and which an error repeating it must escape
    ("prompt-lone-surrogate", C, comp(prompt="a\ud800"), 400, "prompt"),
    ("prompt-list-lone-surrogate", C, comp(prompt=["a", "\udc00b"]), 400, "prompt"),
    ("stop-lone-surrogate", C, comp(stop=["\ud800"]), 400, "stop"),
    ("chat-lone-surrogate", CH, chat(messages=[{"role": "user", "content": "hi \ud800"}]), 400,
     "messages.0.content"),
    ("chat-part-lone-surrogate", CH, chat(messages=[MSG[0], {"role": "user", "content": [
        {"type": "text", "text": "\ud800"}]}]), 400, "messages.1.content"),
    ("model-lone-surrogate", C, comp(model="\ud800"), 404, "model"),
    ("nested-too-deeply", C, b"[" * 100000 + b"]" * 100000, 400, None),
    ("field-nested-too-deeply", C, b'{"prompt": "x", "stop": ' + b"[" * 100000 + b"]" * 100000
     + b"}", 400, None),
    ("temperature-infinity", C, b'{"prompt": "x", "temperature": Infinity}', 400, "temperature"),
    ("completions-tools", C, comp(tools=[{"type": "function", "function": {"name": "f"}}]), 400,
     "tools"),
    ("completions-tool-choice", C, comp(tool_choice="auto"), 400, "tool_choice"),
    ("chat-function-call", CH, chat(function_call="auto"), 400, "function_call"),
    ("body-too-large", C, comp(prompt="x" * (3 << 20)), 413, None),
    ("body-too-large-chunked", C, "chunked", 413, None),
]


def _raw_post(server, path: str, body: bytes | str) -> tuple[int, dict]:
    """Send a large body over a raw socket: the server answers before reading all of it, so
    the client must read the answer even when the rest of its upload is refused."""
    import socket
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        if body == "chunked":   # no Content-Length: the limit must hold while reading
            s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      "Transfer-Encoding: chunked\r\n\r\n".encode())
            piece = b"x" * 65536
            try:
                for _ in range(64):
                    s.sendall(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
            except OSError:
                pass
        else:
            s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {len(body)}\r\n\r\n".encode() + body[:4096])
        data = b""
        while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    head, _, payload = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(payload[payload.index(b"{"):])


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input(tiny_server, case):
    name, path, body, status, param = case
    if status == 413:
        got, obj = _raw_post(tiny_server, path, body if isinstance(body, str) else
                             json.dumps(body).encode())
    else:
        got, obj = tiny_server.post(path, body)
    assert got == status, obj
    err = obj["error"]
    assert err["type"] and err["message"]
    assert err["param"] == param
    if param is not None:
        assert param.split(".")[0] in err["message"]
    if name == "temperature-string":
        assert "should be a number" in err["message"]
    if name == "chat-image-part":
        assert "'image_url' is not supported" in err["message"]
    if name in ("temperature-nan", "temperature-infinity"):
        assert "must be a finite number" in err["message"]
    if "surrogate" in name:
        assert "\\ud800" in err["message"] or "\\udc00" in err["message"]


def test_table_is_large_enough():
    assert len(CASES) >= 30


def test_routes_and_methods(tiny_server):
    import urllib.error
    import urllib.request
    for path, method, status in (("/v1/nothing", "GET", 404), (C, "GET", 405)):
        req = urllib.request.Request(tiny_server.url + path, method=method)
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        assert e.value.code == status
        assert json.loads(e.value.read())["error"]["message"]


def test_serves_after_bad_input(tiny_server):
    for _, path, body, _, _ in CASES[:10]:
        tiny_server.post(path, body)
    status, obj = tiny_server.post(C, comp(max_tokens=5, ignore_eos=True))
    assert status == 200 and obj["usage"]["completion_tokens"] == 5
    status, obj = tiny_server.post(CH, chat(max_tokens=3, ignore_eos=True))
    assert status == 200 and obj["usage"]["completion_tokens"] == 3
    assert "Traceback" not in tiny_server.log()


def test_fields_that_ask_for_nothing_are_accepted(tiny_server):
    """The refused fields pass where they change nothing: best_of equal to n, a text
    response_format, tools the model may not call, an empty suffix."""
    for path, body in ((C, comp(best_of=1, suffix="")),
                       (CH, chat(response_format={"type": "text"})),
                       (CH, chat(tools=[{"type": "function", "function": {"name": "f"}}],
                                 tool_choice="none"))):
        code, obj = tiny_server.post(path, body)
        assert code == 200, obj


def test_null_means_the_default(tiny_server):
    """Fields OpenAI declares nullable take their default when sent as null, and vLLM's
    extras pass when they ask for nothing (false, null, empty)."""
    for path, body in ((C, comp(n=None, stream=None, echo=None, logprobs=None, ignore_eos=None,
                                use_beam_search=False, guided_json=None)),
                       (CH, chat(n=None, stream=None, logprobs=None, min_tokens=None,
                                 add_generation_prompt=None, chat_template_kwargs={}))):
        code, obj = tiny_server.post(path, body)
        assert code == 200, obj
        assert len(obj["choices"]) == 1 and obj["choices"][0]["logprobs"] is None


def test_unknown_fields_are_ignored_and_logged(tiny_server):
    code, obj = tiny_server.post(C, comp(frobnicate=3, zz_extra="x"))
    assert code == 200, obj
    assert "fields present in the request but ignored: frobnicate, zz_extra" in tiny_server.log()

"""Completions' echo and `text_offset` on the tiny model: a prompt of token ids echoes
as exactly its tokens (special ones too), and a stream's offsets equal the whole
answer's even while stop strings hold its text back."""
from __future__ import annotations

import json
import urllib.request

C = "/v1/completions"


def _stream(server, body: dict) -> list[dict]:
    req = urllib.request.Request(server.url + C, data=json.dumps({**body, "stream": True}).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        raw = r.read().decode()
    return [json.loads(e[6:]) for e in raw.split("\n\n") if e.startswith("data: {")]


def _joined(chunks: list[dict]) -> tuple[str, dict]:
    """A stream's text and its log-probabilities, joined."""
    text, lps = "", {"tokens": [], "token_logprobs": [], "text_offset": []}
    for ch in chunks:
        for c in ch["choices"]:
            text += c["text"]
            for k in lps:
                lps[k] += (c["logprobs"] or {}).get(k, [])
    return text, lps


def test_token_id_prompt_echoes_its_special_tokens(tiny_server):
    ids = tiny_server.post("/tokenize", {"prompt": "<|im_start|>user hi<|im_end|>"})[1]["tokens"]
    assert ids[0] == 1 and ids[-1] == 2           # <|im_start|> ... <|im_end|>
    body = {"prompt": ids, "max_tokens": 3, "temperature": 0, "ignore_eos": True, "echo": True,
            "logprobs": 1}
    code, obj = tiny_server.post(C, body)
    assert code == 200, obj
    c = obj["choices"][0]
    assert c["text"].startswith("<|im_start|>user hi<|im_end|>")
    lps = c["logprobs"]
    assert "".join(lps["tokens"][:len(ids)]) == "<|im_start|>user hi<|im_end|>"
    for tok, at in zip(lps["tokens"][:len(ids)], lps["text_offset"]):  # each at its offset
        assert c["text"][at:at + len(tok)] == tok, (tok, at)
    text, streamed = _joined(_stream(tiny_server, body))
    assert text == c["text"] and streamed["text_offset"] == lps["text_offset"]
    code, plain = tiny_server.post(C, {**body, "logprobs": None})
    assert plain["choices"][0]["text"] == c["text"]


def test_streamed_text_offset_equals_the_whole_answers_with_stop_strings(tiny_server):
    base = {"prompt": "the cat", "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "logprobs": 2}
    code, free = tiny_server.post(C, base)
    assert code == 200, free
    text = free["choices"][0]["text"]
    assert len(text) > 12
    # A long stop string that never matches holds the streamed text back by its length;
    # one that matches ends the answer (a partial match of it is held back first).
    cases = [["\x01" * 10], ["\x01" * 10, text[8:12]], [text[4:6] + "\x01"]]
    for echo in (False, True):
        for stop in cases:
            body = {**base, "stop": stop, "echo": echo}
            code, whole = tiny_server.post(C, body)
            assert code == 200, whole
            lps = whole["choices"][0]["logprobs"]
            got, streamed = _joined(_stream(tiny_server, body))
            assert got == whole["choices"][0]["text"], (stop, echo)
            assert streamed == {k: lps[k] for k in streamed}, (stop, echo)
            assert lps["text_offset"] == sorted(lps["text_offset"])

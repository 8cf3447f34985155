"""POST /tokenize and /detokenize (vLLM's): the ids a completion or a chat completion
would be given, the context window beside them, and ids back to text."""
from __future__ import annotations

import pytest

pytest.importorskip("openai")

MSG = [{"role": "user", "content": "What is the capital of France?"}]


def test_prompt_ids_are_the_completions(default_server, client, model):
    code, tok = default_server.post("/tokenize", {"model": model, "prompt": "The capital of France is"})
    assert code == 200 and tok["count"] == len(tok["tokens"]) > 0
    assert tok["max_model_len"] == 1024
    r = client.completions.create(model=model, prompt="The capital of France is", max_tokens=1)
    assert r.usage.prompt_tokens == tok["count"]
    code, back = default_server.post("/detokenize", {"tokens": tok["tokens"]})
    assert code == 200 and back["prompt"].endswith("The capital of France is")


def test_messages_ids_are_the_chat_completions(default_server, client, model):
    code, tok = default_server.post("/tokenize", {"messages": MSG})
    assert code == 200
    r = client.chat.completions.create(model=model, messages=MSG, max_tokens=1)
    assert r.usage.prompt_tokens == tok["count"]
    code, text = default_server.post("/detokenize", {"tokens": tok["tokens"]})
    assert "What is the capital of France?" in text["prompt"] and "<|im_start|>" in text["prompt"]
    code, bare = default_server.post("/tokenize", {"messages": MSG, "add_generation_prompt": False})
    assert code == 200 and bare["count"] < tok["count"]


def test_bad_tokenize_requests(tiny_server):
    for body, status, param in (
            ({}, 400, "prompt"),                                           # neither
            ({"prompt": "a", "messages": MSG}, 400, "prompt"),             # both
            ({"prompt": 5}, 400, "prompt"),
            ({"messages": []}, 400, "messages"),
            ({"prompt": "\ud800"}, 400, "prompt"),                         # lone surrogate
            ({"messages": [{"role": "user", "content": "\ud800"}]}, 400, "messages.0.content"),
            ({"prompt": "a", "tools": [{"type": "function"}]}, 400, "tools"),
            ({"prompt": "a", "model": "gpt-9"}, 404, "model")):
        code, obj = tiny_server.post("/tokenize", body)
        assert code == status and obj["error"]["param"] == param, (body, obj)
    for body, param in (({"tokens": [10 ** 9]}, "tokens"), ({"tokens": ["a"]}, "tokens.0"),
                        ({}, "tokens")):
        code, obj = tiny_server.post("/detokenize", body)
        assert code == 400 and obj["error"]["param"] == param, (body, obj)
    code, obj = tiny_server.post("/detokenize", {"tokens": []})
    assert code == 200 and obj == {"prompt": ""}

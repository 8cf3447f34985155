"""The Jinja environment chat templates run in: transformers' features, sandboxed."""
from __future__ import annotations

import pytest

from slipstream.loader.chat_template import ChatTemplate, ChatTemplateError

MSGS = [{"role": "user", "content": "héllo"}, {"role": "assistant", "content": "hi"}]


def render(source: str, **kwargs) -> str:
    return ChatTemplate(source, {"bos_token": "<s>", "eos_token": "</s>"}).render(MSGS, **kwargs)


def test_special_tokens_and_generation_prompt():
    src = "{{ bos_token }}{% if add_generation_prompt %}GO{% endif %}{{ eos_token }}"
    assert render(src) == "<s>GO</s>"
    assert render(src, add_generation_prompt=False) == "<s></s>"


def test_trim_and_lstrip_blocks():
    src = "{% for m in messages %}\n    {% if m.role == 'user' %}\nU:{{ m.content }}\n    {% endif %}\n{% endfor %}"
    assert render(src) == "U:héllo\n"


def test_loop_controls_and_extra_kwargs():
    src = "{% for m in messages %}{% if loop.index > limit %}{% break %}{% endif %}{{ m.role }};{% endfor %}"
    assert render(src, limit=1) == "user;"


def test_tojson_keeps_unicode():
    assert render("{{ messages[0] | tojson }}") == '{"role": "user", "content": "héllo"}'
    assert render("{{ {'a': 1} | tojson(indent=2) }}") == '{\n  "a": 1\n}'


def test_strftime_now():
    assert len(render("{{ strftime_now('%Y-%m-%d') }}")) == 10


def test_raise_exception_is_a_clear_error():
    with pytest.raises(ChatTemplateError, match="chat template: roles must alternate"):
        render("{{ raise_exception('roles must alternate') }}")


def test_sandbox_refuses_mutation_and_internals():
    with pytest.raises(ChatTemplateError):
        render("{{ messages.append(1) }}")
    with pytest.raises(ChatTemplateError, match="unsafe"):
        render("{{ messages.__class__.__mro__ }}")


def test_syntax_error_names_the_line():
    with pytest.raises(ChatTemplateError, match="syntax error at line 2"):
        ChatTemplate("ok\n{% if %}", {})

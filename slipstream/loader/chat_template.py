"""Rendering a model's Jinja chat template the way transformers does.

The template comes from the model (tokenizer_config.json or GGUF metadata), so
it runs in jinja2's immutable sandbox: it can read its inputs but not reach
Python objects or change them. The environment matches transformers'
(`trim_blocks`, `lstrip_blocks`, the loop-controls extension, `raise_exception`,
`strftime_now` and a `tojson` that keeps non-ASCII text) so that templates
written for transformers render the same text here.
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from slipstream.errors import SlipstreamError


class ChatTemplateError(SlipstreamError, ValueError):
    """The chat template refused the conversation, or the model has none."""


def _raise_exception(message: str):
    raise ChatTemplateError(f"chat template: {message}")


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class ChatTemplate:
    """A compiled template plus the special-token strings it may refer to."""

    def __init__(self, source: str, special_tokens: dict[str, str]):
        self.source = source
        self.special_tokens = dict(special_tokens)   # e.g. {"bos_token": "<s>", ...}
        try:
            self._template = _compile(source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"chat template has a syntax error at line {e.lineno}: {e.message}") from None

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        context = {**self.special_tokens, **kwargs}
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **context)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from None

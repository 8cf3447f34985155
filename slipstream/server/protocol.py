"""The OpenAI request schemas the server accepts, and their mapping to SamplingParams.

Types are strict (a string where a number belongs is refused, not coerced),
ranges follow OpenAI, and every refusal names the field, so a client sees
`{"error": {"message": ..., "param": "top_logprobs", ...}}` with status 400.
Fields OpenAI defines that change nothing here (`user`) are accepted; fields
whose meaning this server does not implement are refused with a 400 naming
them rather than silently dropped (`best_of` above `n`, `suffix`, a
`response_format` other than text, `tools` the model may call, `functions`,
`function_call`, `tool_choice` without tools, tools of any kind outside chat,
and vLLM's extras listed in `UNSUPPORTED`, such as guided decoding and beam
search, when they ask for anything); `null` stands for the default wherever
OpenAI allows it; other unknown fields are ignored (and logged), as vLLM does.
Text the tokenizer reads (prompts, message contents, stop strings) must be
valid Unicode: a lone UTF-16 surrogate (JSON "\\ud800") is refused naming the
field; error messages escape such characters, so they always encode.
"""
from __future__ import annotations

from typing import Literal, Union

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr,
                      field_validator, model_validator)

from slipstream.sampling_params import SamplingParams

Number = Union[StrictInt, StrictFloat]
MAX_N = 16            # samples per prompt
MAX_STOP = 16         # stop strings per request
MAX_LOGPROBS = 5      # completions: OpenAI's limit for `logprobs`
MAX_TOP_LOGPROBS = 20  # chat: OpenAI's limit for `top_logprobs`


# vLLM's request extras that would change the answer, not served here: refused when
# they ask for anything (a value other than null, false, 0, "" or empty), so that a
# client asking for constrained output never gets free text with a 200.
UNSUPPORTED = {
    "guided_json": "guided decoding", "guided_regex": "guided decoding",
    "guided_choice": "guided decoding", "guided_grammar": "guided decoding",
    "guided_decoding_backend": "guided decoding", "guided_whitespace_pattern": "guided decoding",
    "structured_outputs": "structured outputs", "use_beam_search": "beam search",
    "length_penalty": "beam search", "truncate_prompt_tokens": "prompt truncation",
    "prompt_logprobs": "prompt log-probabilities (completions: echo with logprobs)",
    "allowed_token_ids": "allowed token ids", "bad_words": "bad words",
    "logits_processors": "logits processors", "chat_template": "a chat template per request",
    "chat_template_kwargs": "chat template arguments",
    "continue_final_message": "continuing the final message", "documents": "documents",
    "mm_processor_kwargs": "multimodal inputs", "prompt_embeds": "prompt embeddings",
    "return_tokens_as_token_ids": "tokens as token ids",
    "echo": "echo in chat completions (completions echo the prompt)",
    # Chat takes these as its own fields (ChatCompletionRequest.check); elsewhere
    # (completions, /tokenize) any value that asks for something is refused.
    "tools": "function calling (tools)", "tool_choice": "function calling (tools)",
    "functions": "function calling", "function_call": "function calling",
}


def refuse_unsupported(body: dict, allowed: set[str]) -> None:
    """RequestError for the first field of UNSUPPORTED (not in `allowed`, the schema's
    own fields) that asks for something."""
    for name, what in UNSUPPORTED.items():
        if name in body and name not in allowed and body[name] not in (None, False, 0, "", [], {}):
            raise RequestError(f"{name}: {what} is not supported by this server", name)


class RequestError(ValueError):
    """A bad request: `param` names the field, `status` is the HTTP status to answer."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind
        self.code = code


def check_text(text: str, param: str) -> None:
    """RequestError where `text` is not valid Unicode: JSON may spell a lone UTF-16
    surrogate ("\\ud800"), which no tokenizer encodes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(f"{param}: invalid text, a lone surrogate {text[e.start]!r} at "
                           f"character {e.start}", param) from None


def _escaped(text: str | None) -> str | None:
    """User text repeated in an error (a model name, a field's key) with any lone
    surrogate written as `\\ud800`, so the answer always encodes as UTF-8."""
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error",
               code: str | int | None = None) -> dict:
    return {"error": {"message": _escaped(message), "type": kind, "param": _escaped(param),
                      "code": code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


# Fields OpenAI (or vLLM) declare nullable whose null means the default here.
_NULL_IS_DEFAULT = ("n", "stream", "echo", "logprobs", "ignore_eos", "min_tokens",
                    "skip_special_tokens", "include_stop_str_in_output", "add_generation_prompt")


class _Sampling(BaseModel):
    """Fields shared by completions and chat completions."""
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)   # JSON's NaN, Infinity

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data):
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k not in _NULL_IS_DEFAULT}
        return data

    model: StrictStr | None = None
    n: StrictInt = Field(1, ge=1, le=MAX_N)
    temperature: Number | None = Field(None, ge=0, le=2)
    top_p: Number | None = Field(None, gt=0, le=1)
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = Field(None, ge=-(2 ** 63), le=2 ** 64 - 1)
    presence_penalty: Number | None = Field(None, ge=-2, le=2)
    frequency_penalty: Number | None = Field(None, ge=-2, le=2)
    logit_bias: dict[StrictStr, Number] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    # vLLM-style extras
    top_k: StrictInt | None = Field(None, ge=-1)
    min_p: Number | None = Field(None, ge=0, le=1)
    repetition_penalty: Number | None = Field(None, gt=0, le=10)
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = Field(0, ge=0)
    stop_token_ids: list[StrictInt] | None = None
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False

    def _max_tokens(self) -> int | None:  # overridden
        return None

    def _logprobs(self) -> int | None:  # overridden
        return None

    def _prompt_logprobs(self) -> int | None:  # overridden
        return None

    def check(self, max_model_len: int, vocab_size: int) -> None:
        """Checks that need more than one field or the model; RequestError names the field."""
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > MAX_STOP:
            raise RequestError(f"stop: at most {MAX_STOP} stop strings, got {len(stops)}", "stop")
        if any(not s for s in stops):
            raise RequestError("stop: stop strings must not be empty", "stop")
        for s in stops:
            check_text(s, "stop")
        for key, value in (self.logit_bias or {}).items():
            try:
                tid = int(key)
            except ValueError:
                raise RequestError(f"logit_bias: keys must be token ids, got {key!r}",
                                   "logit_bias") from None
            if not 0 <= tid < vocab_size:
                raise RequestError(f"logit_bias: token id {tid} is outside the vocabulary "
                                   f"[0, {vocab_size})", "logit_bias")
            if not -100 <= value <= 100:
                raise RequestError(f"logit_bias: values must be in [-100, 100], got {value}",
                                   "logit_bias")
        for t in self.stop_token_ids or []:
            if not 0 <= t < vocab_size:
                raise RequestError(f"stop_token_ids: token id {t} is outside the vocabulary",
                                   "stop_token_ids")
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options: only allowed when stream is true", "stream_options")

    def sampling_params(self, prompt_len: int, max_model_len: int) -> SamplingParams:
        room = max_model_len - prompt_len
        max_tokens = self._max_tokens()
        name = self._max_tokens_name()
        if max_tokens is not None and max_tokens > room:
            raise RequestError(
                f"{name}: {max_tokens} tokens requested but the prompt has {prompt_len} tokens "
                f"and the context window is {max_model_len}, so at most {room} can be generated",
                name)
        if self.min_tokens > (max_tokens if max_tokens is not None else room):
            raise RequestError(f"min_tokens: {self.min_tokens} is more than {name}", "min_tokens")
        kw = dict(
            n=self.n,
            temperature=1.0 if self.temperature is None else float(self.temperature),
            top_p=1.0 if self.top_p is None else float(self.top_p),
            top_k=self.top_k or 0,
            min_p=float(self.min_p or 0.0),
            presence_penalty=float(self.presence_penalty or 0.0),
            frequency_penalty=float(self.frequency_penalty or 0.0),
            repetition_penalty=float(self.repetition_penalty or 1.0),
            seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos, max_tokens=max_tokens if max_tokens is not None else room,
            min_tokens=self.min_tokens, logprobs=self._logprobs(),
            prompt_logprobs=self._prompt_logprobs(),
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output)
        if self.logit_bias:
            kw["logit_bias"] = {int(k): float(v) for k, v in self.logit_bias.items()}
        try:
            return SamplingParams(**kw)
        except ValueError as e:  # SamplingParams messages start with the field's name
            raise RequestError(str(e), str(e).split(" ", 1)[0]) from None

    def _max_tokens_name(self) -> str:
        return "max_tokens"

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


PromptField = Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]


class CompletionRequest(_Sampling):
    prompt: PromptField
    max_tokens: StrictInt | None = Field(16, ge=0)     # 0: with echo, the prompt scored alone
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: StrictBool = False
    suffix: StrictStr | None = None
    best_of: StrictInt | None = Field(None, ge=1, le=MAX_N)

    def _max_tokens(self) -> int | None:
        # Scoring the prompt (echo, max_tokens 0) still runs one step, whose token the
        # answer leaves out (`score_only`).
        return 1 if self.score_only else self.max_tokens

    @property
    def score_only(self) -> bool:
        """echo with max_tokens 0: the prompt (and its log-probabilities), nothing
        generated, as vLLM and OpenAI's legacy API answer it."""
        return self.echo and self.max_tokens == 0

    def _logprobs(self) -> int | None:
        return self.logprobs

    def _prompt_logprobs(self) -> int | None:
        """echo with logprobs: the prompt's tokens get theirs too (OpenAI's legacy API)."""
        return self.logprobs if self.echo else None

    def check(self, max_model_len: int, vocab_size: int) -> None:
        super().check(max_model_len, vocab_size)
        if self.max_tokens == 0 and not self.echo:
            raise RequestError("max_tokens: must be at least 1 (0 only with echo, which "
                               "scores the prompt)", "max_tokens")
        if self.best_of is not None and self.best_of != self.n:
            raise RequestError("best_of: not supported (as in vLLM's V1 engine); ask for n "
                               "samples and pick among them", "best_of")
        if self.suffix:
            raise RequestError("suffix: insertion after a suffix is not supported", "suffix")

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (text or token ids)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise RequestError("prompt: must not be empty", "prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[ContentPart] | None = None
    name: StrictStr | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, v):
        if isinstance(v, list):
            for part in v:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise ValueError(f"content part type {kind!r} is not supported (text parts "
                                     "only: {\"type\": \"text\", \"text\": ...})")
        return v

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    add_generation_prompt: StrictBool = True
    # Refused unless they ask for nothing (see the module's docstring).
    response_format: dict | None = None
    tools: list | None = None
    tool_choice: StrictStr | dict | None = None
    functions: list | None = None
    function_call: StrictStr | dict | None = None

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    def _max_tokens_name(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def _logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def check(self, max_model_len: int, vocab_size: int) -> None:
        super().check(max_model_len, vocab_size)
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs: requires logprobs to be true", "top_logprobs")
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise RequestError("response_format: only {\"type\": \"text\"} is supported (no "
                               "JSON mode or schema-constrained decoding)", "response_format")
        if self.tools and self.tool_choice != "none":
            raise RequestError("tools: function calling is not supported (send tool_choice "
                               "\"none\" to keep the tools out of the answer)", "tools")
        if not self.tools and self.tool_choice not in (None, "none"):
            raise RequestError("tool_choice: only allowed when tools are given", "tool_choice")
        if self.functions:
            raise RequestError("functions: function calling is not supported", "functions")
        if self.function_call not in (None, "none"):
            raise RequestError("function_call: function calling is not supported",
                               "function_call")

    def chat_messages(self) -> list[dict]:
        return template_messages(self.messages)


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    """Messages as the chat template takes them ("developer" is a system message);
    RequestError naming the message whose content is not valid Unicode."""
    out = []
    for i, m in enumerate(messages):
        check_text(m.text(), f"messages.{i}.content")
        out.append({"role": "system" if m.role == "developer" else m.role, "content": m.text()})
    return out


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's): a prompt, or chat messages through the chat template."""
    model_config = ConfigDict(extra="ignore")
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    # Default: special tokens added to a prompt (as a completion does), none to the
    # chat template's text (which carries its own, as a chat completion does).
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool = True

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise RequestError("prompt: give exactly one of prompt and messages", "prompt")


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's): token ids back to text, special tokens kept."""
    model_config = ConfigDict(extra="ignore")
    model: StrictStr | None = None
    tokens: list[StrictInt]

    def check(self, vocab_size: int) -> None:
        if any(not 0 <= t < vocab_size for t in self.tokens):
            raise RequestError(f"tokens: token ids must be in [0, {vocab_size})", "tokens")

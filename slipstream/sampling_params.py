"""Per-request sampling parameters, in vLLM's shape and with vLLM's rules.

`SamplingParams` is plain data: the engine keeps one per request. Each part of
the engine reads only its own fields:
  sampler       temperature, top_k, top_p, min_p, the penalties, seed, logprobs,
                min_tokens (stop tokens are masked until it is reached)
  scheduler     max_tokens, stop_token_ids, ignore_eos, n
  detokenizer   stop, include_stop_str_in_output, skip_special_tokens,
                spaces_between_special_tokens
  model runner  prompt_logprobs

Every invalid value raises ValueError whose message starts with the field's
name, so the API layer can report it as a 400 for that parameter.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

# Temperatures below this sample greedily (vLLM's _SAMPLING_EPS).
SAMPLING_EPS = 1e-5
# The range torch.Generator.manual_seed accepts; seeds outside it cannot be honoured.
_SEED_MIN, _SEED_MAX = -(2 ** 63), 2 ** 64 - 1


def _check_int(name: str, value, low: int | None = None, allow_none: bool = False):
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be at least {low}, got {value}")


def _check_float(name: str, value, low: float, high: float, low_open: bool = False):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    ok = (low < value if low_open else low <= value) and value <= high
    if not ok:  # also catches NaN, for which every comparison is False
        bracket = "(" if low_open else "["
        raise ValueError(f"{name} must be in {bracket}{low}, {high}], got {value}")


@dataclass
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                     # 0 (or -1, normalised to 0) disables top-k
    min_p: float = 0.0
    seed: int | None = None            # -1 is normalised to None, as in vLLM
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16        # None: up to the model's context limit
    min_tokens: int = 0
    logprobs: int | None = None        # top-k alternatives per sampled token; -1: whole vocab
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None   # token id -> added to its logit, [-100, 100]

    def __post_init__(self) -> None:
        self._normalise_inputs()
        self._verify()
        if self.is_greedy:
            # Filters are meaningless under argmax; clearing them keeps the
            # sampler's "no top-k / no top-p / no min-p" fast paths exact.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _normalise_inputs(self) -> None:
        if self.seed == -1:
            self.seed = None
        if self.top_k == -1:
            self.top_k = 0
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is True:
                setattr(self, name, 1)
            elif value is False:
                setattr(self, name, None)
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        else:
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids))
        else:
            raise ValueError(
                f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}")

    def _verify(self) -> None:
        for flag in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
                     "include_stop_str_in_output"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be True or False, got {getattr(self, flag)!r}")
        _check_int("n", self.n, low=1)
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_float("repetition_penalty", self.repetition_penalty, 0.0, math.inf,
                     low_open=True)
        if not math.isfinite(self.repetition_penalty):
            raise ValueError(f"repetition_penalty must be finite, got {self.repetition_penalty}")
        _check_float("temperature", self.temperature, 0.0, math.inf)
        if not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be finite, got {self.temperature}")
        _check_float("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check_int("top_k", self.top_k)
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 or -1 (disabled) or at least 1, got {self.top_k}")
        _check_float("min_p", self.min_p, 0.0, 1.0)
        _check_int("seed", self.seed, allow_none=True)
        if self.seed is not None and not _SEED_MIN <= self.seed <= _SEED_MAX:
            raise ValueError(f"seed must be in [{_SEED_MIN}, {_SEED_MAX}], got {self.seed}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must hold non-empty strings, got {self.stop!r}")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0
               for t in self.stop_token_ids):
            raise ValueError(
                f"stop_token_ids must hold non-negative integers, got {self.stop_token_ids!r}")
        _check_int("max_tokens", self.max_tokens, low=1, allow_none=True)
        _check_int("min_tokens", self.min_tokens, low=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be at most max_tokens={self.max_tokens}, "
                             f"got {self.min_tokens}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id -> bias, got {self.logit_bias!r}")
            for tid, bias in self.logit_bias.items():
                if isinstance(tid, bool) or not isinstance(tid, int) or tid < 0:
                    raise ValueError(f"logit_bias keys must be non-negative token ids, got {tid!r}")
                _check_float("logit_bias", bias, -100.0, 100.0)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check_int(name, value, allow_none=True)
            if value is not None and value < -1:
                raise ValueError(f"{name} must be None, -1 (whole vocabulary) or "
                                 f"non-negative, got {value}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @property
    def output_text_buffer_length(self) -> int:
        """Characters the detokenizer holds back so a stop string is never streamed
        out before it is recognised (0 when stop strings are kept in the output)."""
        if not self.stop or self.include_stop_str_in_output:
            return 0
        return max(len(s) for s in self.stop) - 1

    def child(self, index: int) -> SamplingParams:
        """Params of the `index`-th of the n sequences of a request (n > 1 fan-out):
        n = 1 and, when a seed is set, seed + index so siblings differ but the
        whole request stays reproducible (vLLM's rule)."""
        seed = None
        if self.seed is not None:      # wrapped into the range a generator accepts
            span = _SEED_MAX - _SEED_MIN + 1
            seed = (self.seed + index - _SEED_MIN) % span + _SEED_MIN
        return dataclasses.replace(self, n=1, seed=seed)

"""Incremental detokenization and stop strings.

Text is produced by decoding a short window of tokens twice (with and without
the newest ones) and taking the difference, so multi-byte characters split
across tokens and tokenizers that strip a leading space at the start of a
decode both come out right. The window starts inside the prompt so the first
generated token keeps its leading space.
"""
from __future__ import annotations

from slipstream.sampling_params import SamplingParams

_PROMPT_CONTEXT = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.skip_special = params.skip_special_tokens
        self.spaces_between_special = params.spaces_between_special_tokens
        self.stop = tuple(params.stop or ())
        self.include_stop = params.include_stop_str_in_output
        self._tokens = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._prefix = 0
        self._read = len(self._tokens)
        self.text = ""
        # Streamed text lags by this many characters so a stop string that is
        # still being completed is never shown.
        self.hold = params.output_text_buffer_length

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special,
                                     spaces_between_special_tokens=self.spaces_between_special)

    def add_tokens(self, token_ids: list[int], check_stop: bool = True) -> str | None:
        """Append tokens' text; returns the stop string that ended the text, if any
        (stop strings are looked for only with `check_stop`)."""
        start = len(self.text)
        for tok in token_ids:
            self._tokens.append(tok)
            prefix_text = self._decode(self._tokens[self._prefix:self._read])
            full_text = self._decode(self._tokens[self._prefix:])
            if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
                self.text += full_text[len(prefix_text):]
                self._prefix, self._read = self._read, len(self._tokens)
        return self._find_stop(start) if check_stop else None

    def flush(self) -> None:
        """At the end, emit the text held back for a character still incomplete; the
        bytes of a character the last token left unfinished (an answer cut by
        max_tokens mid-character) are dropped rather than shown as U+FFFD."""
        if self._read < len(self._tokens):
            prefix_text = self._decode(self._tokens[self._prefix:self._read])
            tail = self._decode(self._tokens[self._prefix:])[len(prefix_text):]
            self.text += tail.rstrip("\ufffd")
            self._prefix = self._read = len(self._tokens)

    def _find_stop(self, start: int) -> str | None:
        if not self.stop or len(self.text) == start:
            return None
        best = None
        for s in self.stop:
            # Only matches that end in the new text are new.
            i = self.text.find(s, max(0, start - len(s) + 1))
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.text = self.text[:i + len(s)] if self.include_stop else self.text[:i]
        return s

    def visible_text(self, finished: bool) -> str:
        if finished or self.hold == 0:
            return self.text
        return self.text[:max(0, len(self.text) - self.hold)]

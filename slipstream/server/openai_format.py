"""RequestOutputs -> OpenAI response objects and stream chunks.

One `Formatter` serves one API call, which may hold several prompts
(completions accept a list) each sampled `n` times: choice index =
prompt_index * n + sample index, as OpenAI numbers them. Streaming keeps, per
choice, how much text and how many tokens were already sent, since the engine
reports cumulative text and token ids, and where in the text the next token
starts: with stop strings the text lags its tokens (held back in case it
becomes a stop string), so `text_offset` follows the tokens, not the text sent.
"""
from __future__ import annotations

import codecs
import json
import time

from slipstream.engine.outputs import CompletionOutput, RequestOutput


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def _finish_reason(c: CompletionOutput) -> str | None:
    return None if c.finish_reason is None else ("length" if c.finish_reason == "length" else "stop")


class Formatter:
    def __init__(self, chat: bool, call_id: str, model: str, n: int, logprobs: int | None,
                 prompt_index: dict[str, int], echo: dict[str, str] | None = None,
                 decode=None, score_only: bool = False, token_bytes=None):
        self.chat, self.id, self.model, self.n = chat, call_id, model, n
        # Completions with echo and max_tokens 0: the prompt alone, the step's one
        # generated token left out of text, log-probabilities and usage.
        self.score_only = score_only
        self.logprobs = logprobs            # top alternatives per token, None: no logprobs
        self.prompt_index = prompt_index    # request id -> prompt position
        self.echo = echo or {}              # request id -> prompt text to prepend
        # token id -> text (the first prompt token's, which has no logprob entry)
        self.decode = decode or (lambda tid: "")
        # token id -> its bytes, whole or part of a character (chat logprobs' `bytes`)
        self.token_bytes = token_bytes
        self._echoed: set[int] = set()      # streamed choices whose prompt went out
        self.created = int(time.time())
        self._sent_text: dict[int, int] = {}
        self._sent_tokens: dict[int, int] = {}
        self._next_offset: dict[int, int] = {}  # text_offset of the next token to send
        self._finished: set[int] = set()
        self._prompt_tokens: dict[str, int] = {}
        self._completion_tokens: dict[int, int] = {}

    def _index(self, out: RequestOutput, c: CompletionOutput) -> int:
        return self.prompt_index[out.request_id] * self.n + c.index

    def _count(self, out: RequestOutput) -> None:
        self._prompt_tokens[out.request_id] = len(out.prompt_token_ids)
        for c in out.outputs:
            self._completion_tokens[self._index(out, c)] = 0 if self.score_only else len(c.token_ids)

    def _reason(self, c: CompletionOutput) -> str | None:
        if self.score_only and c.finish_reason is not None:
            return "length"                 # the 0 tokens asked for, whatever the step drew
        return _finish_reason(c)

    def _answer(self, c: CompletionOutput) -> tuple[str, int]:
        """The generated text to show and the index its tokens' log-probabilities start
        at (past every token when scoring the prompt only)."""
        return ("", len(c.token_ids)) if self.score_only else (c.text, 0)

    def usage(self) -> dict:
        p, c = sum(self._prompt_tokens.values()), sum(self._completion_tokens.values())
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    # ---- logprobs ---------------------------------------------------------

    def _ranked(self, entry) -> list[tuple[int, object]]:
        """(token id, its Logprob) of the top alternatives, best first."""
        ranked = sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None),
                        key=lambda x: x[1].rank)
        return ranked[:self.logprobs]

    def _raw(self, tid: int, decoded: str | None) -> bytes:
        """A token's bytes, whole or part of a character (its text where none are known)."""
        return self.token_bytes(tid) if self.token_bytes is not None else (decoded or "").encode()

    def _spelled(self, tid: int, decoded: str | None) -> str:
        """Completions: how a token is shown in `tokens` / `top_logprobs`. A token
        holding part of a character (a byte-level BPE piece, a <0xE2> byte token) is
        shown as OpenAI shows one, `bytes:\\xe2\\x80`, not as U+FFFD (which also
        made such alternatives collide as keys)."""
        decoded = decoded or ""
        if "\ufffd" in decoded:
            raw = self._raw(tid, decoded)
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError:
                return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        return decoded

    def _characters(self, before: list[int]):
        """A UTF-8 decoder holding the part of a character the tokens before this
        chunk left open (`before`: the last 4 of them; a character is at most 4 bytes):
        `len(dec.decode(bytes))` is then the characters of the text a token
        completes, so `text_offset` follows the text as it is streamed, where a
        character shows once whole."""
        dec = codecs.getincrementaldecoder("utf-8")("replace")
        for t in before[-4:]:
            dec.decode(self._raw(t, None))
        return dec

    def _top_with(self, entry, tid: int) -> dict[str, float]:
        """Completions: the top alternatives and, always, the chosen token (OpenAI's
        rule: up to logprobs + 1 entries)."""
        top = {self._spelled(t, lp.decoded_token): lp.logprob for t, lp in self._ranked(entry)}
        chosen = entry[tid]
        top.setdefault(self._spelled(tid, chosen.decoded_token), chosen.logprob)
        return top

    def _prompt_logprobs(self, out: RequestOutput):
        """Completions with echo: the prompt's tokens, their logprobs (the first has
        none) and offsets in the echoed text, as four lists; None when not asked."""
        if self.chat or self.logprobs is None or out.request_id not in self.echo \
                or out.prompt_logprobs is None:
            return None
        tokens, lps, tops, offsets, at = [], [], [], [], 0
        chars = self._characters([])
        for tid, entry in zip(out.prompt_token_ids, out.prompt_logprobs):
            decoded = self.decode(tid) if entry is None else entry[tid].decoded_token
            tokens.append(self._spelled(tid, decoded))
            lps.append(None if entry is None else entry[tid].logprob)
            tops.append(None if entry is None else self._top_with(entry, tid))
            offsets.append(at)
            at += len(chars.decode(self._raw(tid, decoded)))
        return tokens, lps, tops, offsets

    def _with_prompt(self, out: RequestOutput, lps: dict | None) -> dict | None:
        prompt = self._prompt_logprobs(out)
        if prompt is None or lps is None:
            return lps
        keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
        return {k: part + lps[k] for k, part in zip(keys, prompt)}

    def _logprobs(self, c: CompletionOutput, start: int, text_offset: int):
        """The log-probabilities of the tokens from `start` (completions: the first at
        `text_offset` in the text)."""
        return self._logprobs_at(c, start, text_offset)[0]

    def _logprobs_at(self, c: CompletionOutput, start: int, text_offset: int):
        """`_logprobs` and the text offset past the last of those tokens (where a
        stream's next chunk starts)."""
        if self.logprobs is None or c.logprobs is None:
            return None, text_offset
        ids, entries = c.token_ids[start:], c.logprobs[start:]
        if self.chat:
            content = []
            for tid, entry in zip(ids, entries):
                tok = entry[tid].decoded_token or ""
                content.append({"token": tok, "logprob": entry[tid].logprob,
                                "bytes": list(self._raw(tid, tok)),
                                "top_logprobs": [{"token": lp.decoded_token or "",
                                                  "logprob": lp.logprob,
                                                  "bytes": list(self._raw(t, lp.decoded_token))}
                                                 for t, lp in self._ranked(entry)]})
            return {"content": content}, text_offset
        tokens, token_lps, tops, offsets = [], [], [], []
        chars = self._characters(c.token_ids[max(0, start - 4):start])
        for tid, entry in zip(ids, entries):
            tokens.append(self._spelled(tid, entry[tid].decoded_token))
            token_lps.append(entry[tid].logprob)
            tops.append(self._top_with(entry, tid))
            offsets.append(text_offset)
            text_offset += len(chars.decode(self._raw(tid, entry[tid].decoded_token)))
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
                "text_offset": offsets}, text_offset

    # ---- whole responses --------------------------------------------------

    def response(self, finals: list[RequestOutput]) -> dict:
        choices = []
        for out in finals:
            self._count(out)
            for c in out.outputs:
                i = self._index(out, c)
                prefix = self.echo.get(out.request_id, "")
                text, start = self._answer(c)
                lps = self._with_prompt(out, self._logprobs(c, start, len(prefix)))
                if self.chat:
                    choices.append({"index": i, "message": {"role": "assistant", "content": text},
                                    "logprobs": lps, "finish_reason": self._reason(c)})
                else:
                    choices.append({"index": i, "text": prefix + text, "logprobs": lps,
                                    "finish_reason": self._reason(c)})
        choices.sort(key=lambda ch: ch["index"])
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices,
                "usage": self.usage()}

    # ---- streams ----------------------------------------------------------

    def _chunk(self, choices: list[dict], usage=False, include_usage=False) -> dict:
        obj = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "choices": choices}
        if include_usage:
            obj["usage"] = self.usage() if usage else None
        return obj

    def first_chunks(self, num_prompts: int, include_usage: bool) -> list[str]:
        """Chat streams open each choice with the assistant role; completions with echo
        open with the prompt text."""
        out = []
        for p in range(num_prompts):
            for k in range(self.n):
                i = p * self.n + k
                if self.chat:
                    ch = {"index": i, "delta": {"role": "assistant", "content": ""},
                          "logprobs": None, "finish_reason": None}
                else:
                    rid = next((r for r, q in self.prompt_index.items() if q == p), None)
                    if not self.echo.get(rid) or self.logprobs is not None:
                        continue    # with logprobs the prompt goes with its logprobs, later
                    ch = {"index": i, "text": self.echo[rid], "logprobs": None,
                          "finish_reason": None}
                out.append(sse(self._chunk([ch], include_usage=include_usage)))
        return out

    def chunks(self, out: RequestOutput, include_usage: bool) -> list[str]:
        self._count(out)
        events = []
        for c in out.outputs:
            i = self._index(out, c)
            if i in self._finished:
                continue
            sent_text, sent_tok = self._sent_text.get(i, 0), self._sent_tokens.get(i, 0)
            text, start = self._answer(c)
            sent_tok = max(sent_tok, start)
            delta = text[sent_text:] if len(text) > sent_text else ""
            new_tokens = len(c.token_ids) > sent_tok
            reason = self._reason(c)
            if not delta and reason is None and not (new_tokens and self.logprobs is not None):
                continue
            prefix = self.echo.get(out.request_id, "")
            lps, self._next_offset[i] = self._logprobs_at(c, sent_tok,
                                                          self._next_offset.get(i, len(prefix)))
            if prefix and self.logprobs is not None and i not in self._echoed:
                self._echoed.add(i)         # the echoed prompt opens the first chunk
                delta, lps = prefix + delta, self._with_prompt(out, lps)
            self._sent_text[i] = max(sent_text, len(text))
            self._sent_tokens[i] = len(c.token_ids)
            if reason is not None:
                self._finished.add(i)
            if self.chat:
                ch = {"index": i, "delta": {"content": delta} if delta else {}, "logprobs": lps,
                      "finish_reason": reason}
            else:
                ch = {"index": i, "text": delta, "logprobs": lps, "finish_reason": reason}
            events.append(sse(self._chunk([ch], include_usage=include_usage)))
        return events

    def usage_chunk(self) -> str:
        return sse(self._chunk([], usage=True, include_usage=True))

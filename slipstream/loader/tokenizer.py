"""The tokenizer the engine uses: a `tokenizers.Tokenizer` plus the model's
special-token settings and chat template.

Both model formats end here. A Hugging Face folder gives `tokenizer.json`
directly (settings from tokenizer_config.json and generation_config.json); a
GGUF file gives vocabulary, merges and settings as metadata, from which
`gguf_tokenizer.py` rebuilds the same `tokenizers.Tokenizer`.

Which tokenization is right for the default model (SmolLM2 GGUF). The
original SmolLM2 tokenizer.json pre-tokenizes with
Sequence[Digits(individual_digits=True), ByteLevel(add_prefix_space=False,
use_regex=True)]: digits are cut out one by one first, and the GPT-2 regex then
runs on each stretch between them. llama.cpp's `smollm` pre-tokenizer
(llama-vocab.cpp: regexes `\\p{N}` then the GPT-2 pattern, applied in turn) is
the same rule, and convert_hf_to_gguf.py names the file's pre-tokenizer
`smollm` from the hash of HuggingFaceTB/SmolLM-135M's tokenizer. transformers'
GGUF conversion ignores `tokenizer.ggml.pre == "smollm"` and uses the plain
GPT-2 ByteLevel regex over the whole text, so whitespace before a digit splits
differently: "\\n\\n  0." is ["ĊĊĠĠ", "0", "."] = [39892, 32, 30] in the
original and llama.cpp, but ["ĊĊĠ", "Ġ", "0", "."] = [8866, 216, 32, 30] in
transformers (the GPT-2 regex keeps one space for " 0", and the vocabulary,
trained with digits split off, has no "Ġ0"). llama.cpp is right; slipstream
follows the original (tests/loader/test_tokenizer_gguf.py shows all three).
"""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Sequence

import tokenizers

from slipstream.errors import ModelLoadError
from slipstream.loader.json_file import read_json
from slipstream.loader.chat_template import ChatTemplate, ChatTemplateError


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: printable bytes stand for
    themselves, the others for 256 + n in their order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
            *range(ord("\xae"), ord("\xff") + 1)]
    table, n = {chr(b): b for b in keep}, 0
    for b in range(256):
        if b not in keep:
            table[chr(256 + n)] = b
            n += 1
    return table


class Tokenizer:
    """Text <-> token ids for one model.

    `encode(text)` adds BOS when the model asks for it (`add_bos`); encode a
    rendered chat template with `add_special_tokens=False`, since templates
    usually write BOS themselves. Special tokens written in the text (e.g.
    `<|im_start|>`) always become their single token.
    """

    def __init__(self, backend: tokenizers.Tokenizer, *, bos_token_id: int | None,
                 eos_token_ids: Sequence[int], add_bos: bool, add_eos: bool = False,
                 chat_template: str | None = None, source: str = "model"):
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(dict.fromkeys(eos_token_ids))
        self.add_bos = bool(add_bos) and bos_token_id is not None
        self.add_eos = bool(add_eos) and bool(self.eos_token_ids)
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        added = backend.get_added_tokens_decoder()
        special = {i for i, tok in added.items() if tok.special}
        special.update(self.eos_token_ids)
        if bos_token_id is not None:
            special.add(bos_token_id)
        self.all_special_ids = frozenset(special)
        self.source = source
        tokens = {"bos_token": bos_token_id, "eos_token": self.eos_token_ids[0] if self.eos_token_ids else None}
        self._special_strings = {k: backend.id_to_token(v) for k, v in tokens.items() if v is not None}
        self._chat = ChatTemplate(chat_template, self._special_strings) if chat_template else None

    # ids <-> text
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens:
            if self.add_bos:
                ids.insert(0, self.bos_token_id)
            if self.add_eos:
                ids.append(self.eos_token_ids[0])
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True,
               spaces_between_special_tokens: bool = False) -> str:
        """With `spaces_between_special_tokens` (and special tokens kept), each
        special token is set apart from its neighbours by a space, as Hugging
        Face's slow tokenizers do; otherwise the text is the tokenizer's own."""
        ids = list(ids)
        if skip_special_tokens or not spaces_between_special_tokens:
            return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)
        parts, run = [], []
        for t in ids:
            if t in self.all_special_ids:
                if run:
                    parts.append(self.backend.decode(run, skip_special_tokens=False))
                    run = []
                parts.append(self.backend.decode([t], skip_special_tokens=False))
            else:
                run.append(t)
        if run:
            parts.append(self.backend.decode(run, skip_special_tokens=False))
        return " ".join(parts)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry (e.g. "Ġworld"), not its text; None if out of range."""
        return self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for, also where they are part of a character
        (byte-level BPE pieces, SentencePiece's <0xE6> byte tokens), so that a
        client joining the bytes of the tokens gets the text (OpenAI's `bytes`)."""
        piece = self.backend.id_to_token(token_id)
        if piece is None or token_id in self.all_special_ids:
            return self.decode([token_id], skip_special_tokens=False).encode()
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        if self._byte_level:
            table = _unicode_to_byte()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        return piece.replace("\u2581", " ").encode()

    @functools.cached_property
    def _byte_level(self) -> bool:
        """GPT-2 style byte-level BPE: pieces spell their bytes as printable characters."""
        try:
            return json.loads(self.backend.to_str()).get("decoder", {}).get("type") == "ByteLevel"
        except Exception:  # noqa: BLE001 - an unusual serialization: treat pieces as text
            return False

    # chat
    @property
    def chat_template(self) -> str | None:
        return self._chat.source if self._chat else None

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **kwargs) -> str:
        if self._chat is None:
            raise ChatTemplateError(
                f"{self.source} has no chat template, so it cannot chat; "
                "give it a plain prompt instead")
        return self._chat.render(messages, add_generation_prompt=add_generation_prompt, **kwargs)


def _token_content(value) -> str | None:
    """tokenizer_config.json spells a token as a string or as a serialized AddedToken."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _ids(value) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]


def _chat_template_of(folder: Path, tok_config: dict) -> str | None:
    template = tok_config.get("chat_template")
    if isinstance(template, list):   # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default")
    if template is None and (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    if template is None and (folder / "chat_template.json").is_file():
        template = read_json(folder / "chat_template.json").get("chat_template")
    return template


def _adds(backend: tokenizers.Tokenizer, token_id: int | None, first: bool) -> bool:
    """Does tokenizer.json's post-processor add this token at the start (or end)?"""
    if token_id is None:
        return False
    plain = backend.encode("a", add_special_tokens=False).ids
    full = backend.encode("a", add_special_tokens=True).ids
    if len(full) <= len(plain):
        return False
    return (full[0] if first else full[-1]) == token_id


def load_hf_tokenizer(folder: Path, model_eos_ids: Sequence[int] = ()) -> Tokenizer:
    """The tokenizer of a Hugging Face model folder (needs tokenizer.json)."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        hint = " (it has only a SentencePiece tokenizer.model)" if (folder / "tokenizer.model").is_file() else ""
        raise ModelLoadError(
            f"{folder}: no tokenizer.json{hint}; slipstream reads the fast-tokenizer file "
            "tokenizer.json, which transformers writes with tokenizer.save_pretrained()")
    try:
        backend = tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:
        raise ModelLoadError(f"{path}: not a valid tokenizer.json ({e})") from None
    tok_config = read_json(folder / "tokenizer_config.json") if (folder / "tokenizer_config.json").is_file() else {}
    gen_config = read_json(folder / "generation_config.json") if (folder / "generation_config.json").is_file() else {}

    bos = _token_content(tok_config.get("bos_token"))
    eos = _token_content(tok_config.get("eos_token"))
    bos_id = backend.token_to_id(bos) if bos else gen_config.get("bos_token_id")
    eos_ids = ([backend.token_to_id(eos)] if eos and backend.token_to_id(eos) is not None else [])
    eos_ids += _ids(gen_config.get("eos_token_id")) + list(model_eos_ids)
    add_bos = tok_config.get("add_bos_token")
    if add_bos is None:
        add_bos = _adds(backend, bos_id, first=True)
    add_eos = tok_config.get("add_eos_token")
    if add_eos is None:
        add_eos = _adds(backend, eos_ids[0] if eos_ids else None, first=False)
    return Tokenizer(backend, bos_token_id=bos_id, eos_token_ids=eos_ids, add_bos=add_bos,
                     add_eos=add_eos, chat_template=_chat_template_of(folder, tok_config),
                     source=str(folder))

"""Rebuilding a model's original tokenizer from GGUF metadata.

A GGUF file stores the vocabulary (`tokenizer.ggml.tokens`), the BPE merges,
the token types and the name of the pre-tokenizer (`tokenizer.ggml.pre`), but
not the pre-tokenizer itself: llama.cpp keeps each one as code. The table
below maps those names to the pre-tokenizer of the original tokenizer.json, so
that ids match the model's own tokenizer (see tokenizer.py for why this matters
on SmolLM2). Two vocabulary models are supported:

- `gpt2`: byte-level BPE (SmolLM, Llama 3, Qwen2, GPT-2 style vocabularies);
- `llama`: SentencePiece BPE as in Llama 2 GGUFs, with `▁` for spaces, byte
  fallback tokens `<0xXX>`, and merges ordered by the token scores.
"""
from __future__ import annotations

from typing import Callable

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as Backend

from slipstream.errors import ModelLoadError
from slipstream.loader.tokenizer import Tokenizer

# llama.cpp's token types (llama_token_type / gguf TokenType)
_CONTROL, _USER_DEFINED = 3, 4

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _gpt2() -> pre_tokenizers.PreTokenizer:
    # ByteLevel's own regex is GPT-2's.
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_gpt2() -> pre_tokenizers.PreTokenizer:
    # SmolLM / StarCoder: each digit alone, then GPT-2's regex between them.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2()])


def _split_then_bytes(pattern: str) -> Callable[[], pre_tokenizers.PreTokenizer]:
    return lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


# tokenizer.ggml.pre -> (pre-tokenizer of the original tokenizer.json, NFC normalizer?)
_PRE_TOKENIZERS: dict[str, tuple[Callable[[], pre_tokenizers.PreTokenizer], bool]] = {
    "default": (_gpt2, False), "gpt2": (_gpt2, False), "gpt-2": (_gpt2, False),
    "mpt": (_gpt2, False), "olmo": (_gpt2, False),
    "smollm": (_digits_gpt2, False), "starcoder": (_digits_gpt2, False),
    "refact": (_digits_gpt2, False), "codeshell": (_digits_gpt2, False),
    "llama-bpe": (_split_then_bytes(_LLAMA3_SPLIT), False),
    "llama3": (_split_then_bytes(_LLAMA3_SPLIT), False),
    "llama-v3": (_split_then_bytes(_LLAMA3_SPLIT), False),
    "smaug-bpe": (_split_then_bytes(_LLAMA3_SPLIT), False),
    "dbrx": (_split_then_bytes(_LLAMA3_SPLIT), False),
    "qwen2": (_split_then_bytes(_QWEN2_SPLIT), True),
    "deepseek-r1-qwen": (_split_then_bytes(_QWEN2_SPLIT), True),
}


def _byte_level_backend(meta: dict) -> Backend:
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise ModelLoadError(
            f"GGUF pre-tokenizer {pre!r} is not supported, so its text would be tokenized "
            f"differently from the original model; supported: {', '.join(sorted(_PRE_TOKENIZERS))}")
    make_pre, nfc = _PRE_TOKENIZERS[pre]
    vocab = {tok: i for i, tok in enumerate(meta["tokenizer.ggml.tokens"])}
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    backend = Backend(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    backend.pre_tokenizer = make_pre()
    if nfc:
        backend.normalizer = normalizers.NFC()
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a token into
    two tokens, best-scored result first (how SentencePiece picks its next merge)."""
    ids = {tok: i for i, tok in enumerate(tokens)}
    ranked = []
    for tok, score in zip(tokens, scores):
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            if left in ids and right in ids:
                ranked.append((-score, ids[left], ids[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _sentencepiece_backend(meta: dict) -> Backend:
    tokens = list(meta["tokenizer.ggml.tokens"])
    scores = list(meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
    unk_id = meta.get("tokenizer.ggml.unknown_token_id", 0)
    vocab = {tok: i for i, tok in enumerate(tokens)}
    backend = Backend(models.BPE(vocab=vocab, merges=_sentencepiece_merges(tokens, scores),
                                 unk_token=tokens[unk_id], fuse_unk=True, byte_fallback=True))
    prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    steps = [normalizers.Prepend("▁")] if prefix else []
    backend.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "▁")])
    dec = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        dec.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(dec)
    return backend


def _add_special_tokens(backend: Backend, meta: dict) -> None:
    """Control tokens become special (matched whole, skipped on decode);
    user-defined ones are matched whole but kept in decoded text."""
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or []
    backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                for i, t in enumerate(types) if t == _CONTROL])
    backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                        for i, t in enumerate(types) if t == _USER_DEFINED])


_BUILDERS = {"gpt2": _byte_level_backend, "llama": _sentencepiece_backend}


def build_gguf_tokenizer(meta: dict, source: str, eos_token_ids: tuple[int, ...]) -> Tokenizer:
    """`meta`: the file's `tokenizer.*` metadata, plain Python values."""
    kind = meta.get("tokenizer.ggml.model")
    if kind not in _BUILDERS:
        raise ModelLoadError(
            f"{source}: GGUF tokenizer model {kind!r} is not supported; "
            f"supported: {', '.join(sorted(_BUILDERS))}")
    if "tokenizer.ggml.tokens" not in meta:
        raise ModelLoadError(f"{source}: the GGUF file has no tokenizer vocabulary (tokenizer.ggml.tokens)")
    backend = _BUILDERS[kind](meta)
    _add_special_tokens(backend, meta)
    # llama.cpp adds BOS to SentencePiece vocabularies unless the file says otherwise.
    add_bos = meta.get("tokenizer.ggml.add_bos_token", kind == "llama")
    return Tokenizer(backend, bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
                     eos_token_ids=eos_token_ids, add_bos=add_bos,
                     add_eos=meta.get("tokenizer.ggml.add_eos_token", False),
                     chat_template=meta.get("tokenizer.chat_template"), source=source)

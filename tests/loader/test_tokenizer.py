"""Tokenizers from Hugging Face folders, and from SentencePiece-style GGUF metadata."""
from __future__ import annotations

import json

import gguf
import pytest
from tokenizers import processors

from slipstream.loader import open_model
from slipstream.loader.chat_template import ChatTemplateError
from slipstream.loader.gguf_tokenizer import build_gguf_tokenizer
from tests.loader.checkpoints import byte_level_backend, write_hf_tokenizer

TEXTS = ["the 12", " the cat in a hat", "x  = 3.5\n\n  y", "héllo 🤗", "<|im_start|>hi<|im_end|>"]


def test_hand_derived_ids(save_hf):
    """Ids follow from the tiny vocabulary: 3 specials, then the 256 bytes (id 3 + byte),
    then one token per merge ("Ġt" 259, "he" 260, "Ġthe" 261, ..., "12" 264)."""
    tok = open_model(save_hf("llama")).tokenizer()
    # "the 12": Digits splits off "1" and "2", so the merge "1 2" never applies
    assert tok.encode("the 12") == [3 + ord("t"), 260, 3 + ord(" "), 3 + ord("1"), 3 + ord("2")]
    assert tok.encode(" the") == [261]
    assert tok.encode("<|im_start|>hi") == [1, 3 + ord("h"), 3 + ord("i")]


@pytest.mark.parametrize("text", TEXTS)
def test_matches_transformers(save_hf, text):
    from transformers import AutoTokenizer
    folder = save_hf("llama")
    ours = open_model(folder).tokenizer()
    theirs = AutoTokenizer.from_pretrained(folder)
    assert ours.encode(text) == theirs.encode(text)
    ids = ours.encode(text)
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)


def test_settings_from_tokenizer_config(save_hf):
    folder = save_hf("llama")
    tok = open_model(folder).tokenizer()
    assert (tok.bos_token_id, tok.eos_token_ids, tok.add_bos) == (0, (2,), False)
    assert tok.all_special_ids == {0, 1, 2}
    write_hf_tokenizer(folder, add_bos_token=True)
    tok = open_model(folder).tokenizer()
    assert tok.encode("hi") == [0, 3 + ord("h"), 3 + ord("i")]
    assert tok.encode("hi", add_special_tokens=False) == [3 + ord("h"), 3 + ord("i")]


def test_bos_from_post_processor(save_hf):
    """Without add_bos_token, tokenizer.json's own post-processor decides (as in Llama 3)."""
    folder = save_hf("llama")
    backend = byte_level_backend()
    backend.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)])
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|endoftext|>"}))
    tok = open_model(folder).tokenizer()
    assert tok.add_bos and tok.encode("hi") == [0, 3 + ord("h"), 3 + ord("i")]


def test_chat_template_sources(save_hf):
    folder = save_hf("llama")
    msgs = [{"role": "user", "content": "hi"}]
    tok = open_model(folder).tokenizer()
    assert tok.apply_chat_template(msgs) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == "<|im_start|>user\nhi<|im_end|>\n"
    write_hf_tokenizer(folder, chat_template=None)
    (folder / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[0]['content'] }}")
    assert open_model(folder).tokenizer().apply_chat_template(msgs) == "<|endoftext|>hi"
    (folder / "chat_template.jinja").unlink()
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        open_model(folder).tokenizer().apply_chat_template(msgs)


def _spm_meta(**extra) -> dict:
    """A tiny SentencePiece vocabulary as a Llama 2 GGUF stores it."""
    pieces = [("▁", -1.0), ("a", -2.0), ("b", -3.0), ("c", -4.0), ("▁a", -5.0), ("ab", -6.0),
              ("▁ab", -7.0), ("bc", -8.0), ("▁b", -9.0)]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + [p for p, _ in pieces]
    T = gguf.TokenType
    types = [T.UNKNOWN, T.CONTROL, T.CONTROL] + [T.BYTE] * 256 + [T.NORMAL] * len(pieces)
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": [0.0] * 259 + [s for _, s in pieces],
            "tokenizer.ggml.token_type": [int(t) for t in types],
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0, **extra}


def test_sentencepiece_vocabulary():
    """'ab bc' -> '▁ab▁bc'; merging the best-scored pair each time: ▁a (-5), then ▁ab (-7),
    then bc (-8) -> [▁ab, ▁, bc]. 'é' is not a piece: its UTF-8 bytes stand in."""
    tok = build_gguf_tokenizer(_spm_meta(), "tiny.gguf", (2,))
    first = 259   # the first piece after the specials and the 256 byte tokens
    assert tok.add_bos and tok.encode("ab bc") == [1, first + 6, first + 0, first + 7]
    assert tok.encode("é", add_special_tokens=False) == [first + 0, 3 + 0xC3, 3 + 0xA9]
    assert tok.decode(tok.encode("ab bc é")) == "ab bc é"
    no_prefix = build_gguf_tokenizer(_spm_meta(**{"tokenizer.ggml.add_space_prefix": False,
                                                  "tokenizer.ggml.add_bos_token": False}), "t", (2,))
    assert no_prefix.encode("ab") == [first + 5]

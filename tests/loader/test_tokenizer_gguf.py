"""The default model's tokenizer, rebuilt from GGUF metadata, against the
original SmolLM2 tokenizer, llama.cpp's rule, and transformers' GGUF conversion.

The original SmolLM2 tokenizer.json (HuggingFaceTB/SmolLM2-135M-Instruct) has
pre_tokenizer Sequence[Digits(individual_digits=True), ByteLevel(add_prefix_space=False,
use_regex=True)], no normalizer, and the same vocabulary and merges the GGUF file
copies. `original` below rebuilds exactly that, independently of slipstream's code.
llama.cpp's `smollm` pre-tokenizer is the regex `\\p{N}`, then GPT-2's regex, each
applied to the pieces the one before left (llama-vocab.cpp); `llama_cpp` below is
that rule written with tokenizers' Split.
"""
from __future__ import annotations

import gguf
import pytest
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from slipstream.loader import default_model_path

GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
TRICKY = [
    "\n\n  0.",
    "x  = 3.14159\n\n\n    return y",
    "   leading and trailing   ",
    "Tabs\tand\r\nCRLF\n \n",
    "héllo wörld — naïve café 你好 🤗",
    "It's 1,000,000 dollars; they'll've THEY'RE",
    "def f(a, b):\n    return a**2 + b  # comment\n",
    "<|im_start|>user\nHi 2 you<|im_end|>\n",
    "digits ١٢٣ ½ Ⅻ 2024-11-29",
    "a\n\n\nb  \t  c",
    "",
]


@pytest.fixture(scope="module")
def vocab():
    reader = gguf.GGUFReader(default_model_path())
    field = lambda key: reader.fields[key].contents()  # noqa: E731
    return field("tokenizer.ggml.tokens"), field("tokenizer.ggml.merges"), field("tokenizer.ggml.token_type")


def _bpe(vocab, pre) -> Tokenizer:
    tokens, merges, types = vocab
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                               merges=[tuple(m.split(" ")) for m in merges]))
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, types) if kind == 3])
    return tok


@pytest.fixture(scope="module")
def original(vocab):
    return _bpe(vocab, pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]))


@pytest.fixture(scope="module")
def llama_cpp(vocab):
    return _bpe(vocab, pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
        pre_tokenizers.Split(Regex(GPT2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]))


@pytest.fixture(scope="module")
def transformers_gguf():
    from transformers import AutoTokenizer
    path = default_model_path()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def test_hand_derived_ids(default_tokenizer, vocab):
    """'\\n\\n  0.': Digits cuts out "0", leaving "\\n\\n  " and "."; GPT-2's `\\s+(?!\\S)`
    takes the whole run of whitespace, which the vocabulary holds as one token."""
    tokens = vocab[0]
    ids = default_tokenizer.encode("\n\n  0.")
    assert [tokens[i] for i in ids] == ["ĊĊĠĠ", "0", "."]
    assert ids == [39892, 32, 30]
    # digits are never merged: the vocabulary has no multi-digit token to merge into
    assert default_tokenizer.encode("12345") == [33, 34, 35, 36, 37]
    assert [tokens[i] for i in default_tokenizer.encode(" the cat")] == ["Ġthe", "Ġcat"]


@pytest.mark.parametrize("text", TRICKY)
def test_matches_original_tokenizer(default_tokenizer, original, text):
    assert default_tokenizer.encode(text, add_special_tokens=False) == original.encode(text).ids


@pytest.mark.parametrize("text", TRICKY)
def test_llama_cpp_rule_matches_original(llama_cpp, original, text):
    assert llama_cpp.encode(text).ids == original.encode(text).ids


def test_transformers_gguf_conversion_differs(transformers_gguf, original):
    """transformers drops the Digits step (it ignores tokenizer.ggml.pre == "smollm"),
    so GPT-2's regex keeps a space for " 0" and the whitespace run splits differently."""
    text = "\n\n  0."
    theirs = transformers_gguf.encode(text, add_special_tokens=False)
    assert theirs == [8866, 216, 32, 30]       # "ĊĊĠ", "Ġ", "0", "."
    assert original.encode(text).ids == [39892, 32, 30]
    # where no whitespace run meets a digit, they agree
    same = "Hello world, it's 42!"
    assert transformers_gguf.encode(same, add_special_tokens=False) == original.encode(same).ids


def test_special_tokens(default_tokenizer):
    tok = default_tokenizer
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (2,) and tok.add_bos is False
    assert tok.all_special_ids == frozenset(range(17))   # the 17 control tokens of SmolLM2
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and len(ids) == 5
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


@pytest.mark.parametrize("text", TRICKY)
def test_decode_round_trip(default_tokenizer, text):
    ids = default_tokenizer.encode(text)
    assert default_tokenizer.decode(ids, skip_special_tokens=False) == text


def test_chat_template(default_tokenizer):
    text = default_tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                    "Hugging Face<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    ids = default_tokenizer.encode(text, add_special_tokens=False)
    assert ids.count(1) == 3 and ids.count(2) == 2


def test_spaces_between_special_tokens(default_tokenizer):
    from slipstream.engine.detokenizer import IncrementalDetokenizer
    from slipstream.sampling_params import SamplingParams
    tok = default_tokenizer
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)
    assert ids[0] in tok.all_special_ids and ids[-1] in tok.all_special_ids
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"
    spaced = tok.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=True)
    assert spaced == "<|im_start|> user\nhi <|im_end|>"
    assert tok.decode(ids, spaces_between_special_tokens=True) == "user\nhi"
    # The detokenizer honours the sampling parameter, token by token.
    for flag, expect in ((True, spaced), (False, "<|im_start|>user\nhi<|im_end|>")):
        d = IncrementalDetokenizer(tok, [], SamplingParams(skip_special_tokens=False,
                                                           spaces_between_special_tokens=flag))
        for t in ids:
            d.add_tokens([t])
        d.flush()
        assert d.text == expect


def test_an_answer_cut_mid_character_ends_without_a_replacement_character(default_tokenizer):
    """The byte tokens of a character the answer stopped inside (max_tokens) are
    dropped at the end, not shown as U+FFFD; complete characters all come out."""
    from slipstream.engine.detokenizer import IncrementalDetokenizer
    from slipstream.sampling_params import SamplingParams
    tok = default_tokenizer
    ids = tok.encode("日本の首都", add_special_tokens=False)
    texts = []
    for k in range(1, len(ids) + 1):
        d = IncrementalDetokenizer(tok, [], SamplingParams())
        for t in ids[:k]:
            d.add_tokens([t])
        d.flush()
        assert "\ufffd" not in d.text and "日本の首都".startswith(d.text)
        texts.append(d.text)
    assert texts[-1] == "日本の首都" and "" in texts   # some prefixes end mid-character


def test_token_bytes_join_into_the_text(default_tokenizer):
    """Each token's bytes, also those of part of a character, join into the text
    (what OpenAI's logprob `bytes` are for); and chat logprobs carry them."""
    from slipstream.engine.outputs import CompletionOutput, Logprob, RequestOutput
    from slipstream.server.openai_format import Formatter
    tok = default_tokenizer
    for text in ("日本の首都", "Emoji: 😀 😃", " plain words", "<|im_start|>user\nhi"):
        ids = tok.encode(text, add_special_tokens=False)
        assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()
    ids = tok.encode("日本", add_special_tokens=False)
    entries = [{t: Logprob(-0.5, 1, tok.decode([t]))} for t in ids]
    out = RequestOutput("r", None, [1], [CompletionOutput(0, "日本", ids, -1.0, entries, "length")],
                        True)
    fmt = Formatter(True, "c", "m", 1, 1, {"r": 0}, token_bytes=tok.token_bytes)
    content = fmt.response([out])["choices"][0]["logprobs"]["content"]
    assert bytes(sum((c["bytes"] for c in content), [])) == "日本".encode()
    assert any(c["token"] == "\ufffd" for c in content)       # partial characters as text
    assert [c["top_logprobs"][0]["bytes"] for c in content] == [c["bytes"] for c in content]


def test_completion_logprobs_spell_partial_characters_as_bytes(default_tokenizer):
    """Completions: a token holding part of a character is shown as OpenAI shows
    one (`bytes:\\xe6\\x97`), alternatives that are such pieces stay apart as keys,
    and `text_offset` counts the characters of the text, also in a stream cut
    inside a character (where the text sent so far stops before it)."""
    from slipstream.engine.outputs import CompletionOutput, Logprob, RequestOutput
    from slipstream.server.openai_format import Formatter
    tok = default_tokenizer
    text = "a日本の首都 ok"
    ids = tok.encode(text, add_special_tokens=False)
    parts = [t for t in ids if "\ufffd" in tok.decode([t])]
    assert len(set(parts)) >= 2                             # the text has split characters

    def entries():
        return [{t: Logprob(-0.5, 1, tok.decode([t])),
                 **{p: Logprob(-1.0 - j, 2 + j, tok.decode([p])) for j, p in enumerate(parts[:2]) if p != t}}
                for t in ids]

    def output():
        return CompletionOutput(0, text, ids, -1.0, entries(), "length")
    fmt = Formatter(False, "c", "m", 1, 2, {"r": 0}, token_bytes=tok.token_bytes)
    lp = fmt.response([RequestOutput("r", None, [1], [output()], True)])["choices"][0]["logprobs"]
    assert "\ufffd" not in "".join(lp["tokens"])
    assert any(t.startswith("bytes:\\x") for t in lp["tokens"])
    joined = b"".join(bytes.fromhex(t[6:].replace("\\x", "")) if t.startswith("bytes:") else t.encode()
                      for t in lp["tokens"])
    assert joined == text.encode()
    assert all(len(top) >= 2 for top in lp["top_logprobs"])     # piece alternatives apart
    # each offset: the characters of the text completed before the token
    for k, o in enumerate(lp["text_offset"]):
        done = b"".join(tok.token_bytes(t) for t in ids[:k]).decode("utf-8", "ignore")
        assert o == len(done)
        if not lp["tokens"][k].startswith("bytes:"):
            assert text[o:o + len(lp["tokens"][k])] == lp["tokens"][k]
    # a stream cut after any token gives the same offsets on both sides of the cut
    for cut in range(1, len(ids)):
        sent = len(b"".join(tok.token_bytes(t) for t in ids[:cut]).decode("utf-8", "ignore"))
        first = fmt._logprobs(output(), 0, 0)["text_offset"][:cut]
        rest = fmt._logprobs(output(), cut, sent)["text_offset"]
        assert first + rest == lp["text_offset"], cut

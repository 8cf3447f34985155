"""Tiny checkpoints for the loader tests: random Hugging Face models saved with
transformers, and GGUF files written the way llama.cpp's converter writes them
(q/k rows permuted, norms in F32, a small byte-level vocabulary)."""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch

Q = gguf.GGMLQuantizationType
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "1 2"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_alphabet() -> list[str]:
    """GPT-2's printable spelling of the 256 bytes, in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    spelled, extra = {}, 0
    for b in range(256):
        if b in keep:
            spelled[b] = chr(b)
        else:
            spelled[b] = chr(256 + extra)
            extra += 1
    return [spelled[b] for b in range(256)]


def tiny_vocab() -> tuple[list[str], list[int]]:
    """Specials first (ids 0-2, control), then the bytes, then one token per merge."""
    tokens = SPECIALS + byte_alphabet() + [m.replace(" ", "") for m in MERGES]
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return tokens, types


VOCAB_SIZE = len(tiny_vocab()[0])   # 265


def hf_config(arch: str, tie: bool = False):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config
    common = dict(vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  tie_word_embeddings=tie, bos_token_id=0, eos_token_id=2, rms_norm_eps=1e-5)
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}[arch]
    extra = {"sliding_window": 64} if arch == "mistral" else {}
    return cls(**common, **extra)


def byte_level_backend():
    """The tiny vocabulary as a tokenizers.Tokenizer with SmolLM2's pre-tokenizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    tokens, _ = tiny_vocab()
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                               merges=[tuple(m.split(" ")) for m in MERGES]))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    return tok


def write_hf_tokenizer(folder: Path, **config) -> None:
    byte_level_backend().save(str(folder / "tokenizer.json"))
    settings = {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "add_bos_token": False,
                "chat_template": CHAT_TEMPLATE, **config}
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))


# --- GGUF, written like llama.cpp's convert_hf_to_gguf.py ---------------------------

_GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_GGUF_LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf: str) -> str:
    if hf in _GGUF_NAMES:
        return _GGUF_NAMES[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_GGUF_LAYER[module]}.{kind}"


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: rotate-half rows -> interleaved rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def quantize(w: np.ndarray, qtype) -> np.ndarray:
    if qtype == Q.Q6_K:
        return quantize_q6_k(w)
    return gguf.quants.quantize(w, qtype)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """A plain Q6_K quantizer (the gguf package has none), the inverse of the byte
    layout gguf.quants.Q6_K.dequantize_blocks reads: per 256 values, 128 bytes of low
    nibbles, 64 bytes of high 2-bit pairs, 16 int8 sub-block scales, one fp16 d."""
    blocks = w.astype(np.float32).reshape(-1, 256)
    n = blocks.shape[0]
    sub = blocks.reshape(n, 16, 16)
    amax = np.abs(sub).max(axis=-1)                                 # [n, 16]
    d = np.maximum(amax.max(axis=-1), 1e-12) / (31 * 127)           # [n]
    d16 = d.astype(np.float16)
    scales = np.clip(np.round(amax / (31 * d16.astype(np.float32)[:, None])), 1, 127).astype(np.int8)
    step = d16.astype(np.float32)[:, None, None] * scales.astype(np.float32)[..., None]
    q = (np.clip(np.round(sub / step), -32, 31) + 32).astype(np.uint8).reshape(n, 256)
    # element e of a half h = e // 128: r = e % 128; low nibble in ql[h*64 + r % 64] at bit 4*(r // 64),
    # high pair in qh[h*32 + r % 32] at bit 2*(r // 32)
    ql = np.zeros((n, 128), np.uint8)
    qh = np.zeros((n, 64), np.uint8)
    for e in range(256):
        h, r = divmod(e, 128)
        ql[:, h * 64 + r % 64] |= (q[:, e] & 0xF) << (4 * (r // 64))
        qh[:, h * 32 + r % 32] |= (q[:, e] >> 4) << (2 * (r // 32))
    out = np.concatenate([ql, qh, scales.view(np.uint8), d16.reshape(n, 1).view(np.uint8)], axis=1)
    return out.reshape(*w.shape[:-1], w.shape[-1] // 256 * 210)


def write_gguf(path: Path, model, qtype=Q.F32, arch: str = "llama", pre: str = "smollm",
               extra_meta=None, skip: tuple[str, ...] = (), extra_tensors=None) -> Path:
    """The model's weights (q/k rows permuted for `llama`, as llama.cpp does), 2-D
    weights in `qtype` and norms/biases in F32, plus the tiny tokenizer."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    tokens, types = tiny_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(0)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    for key, value in (extra_meta or {}).items():
        getattr(w, f"add_{key}")(value)
    for name, tensor in model.state_dict().items():
        if name in skip or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        data = tensor.detach().float().numpy()
        if arch == "llama" and ".q_proj." in name:
            data = llamacpp_permute(data, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            data = llamacpp_permute(data, cfg.num_key_value_heads)
        if data.ndim == 2 and qtype != Q.F32:
            w.add_tensor(gguf_name(name), quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name(name), data)
    for name, data in (extra_tensors or {}).items():
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path

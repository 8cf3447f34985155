"""A GGUF model file, read with the `gguf` package.

Weights come out under Hugging Face names and in Hugging Face layout,
dequantized one tensor at a time as `weights()` is iterated (the file itself
stays memory-mapped), so peak memory is the model in float plus one tensor.

Layout: llama.cpp's converter permutes the rows of attn_q / attn_k of `llama`
models from Hugging Face's rotate-half RoPE order to its interleaved order;
`_unpermute` undoes it (the same inverse transformers applies), per head group.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator

import gguf
import numpy as np
import torch

from slipstream.config import ModelConfig
from slipstream.errors import ModelLoadError
from slipstream.loader.gguf_config import GGUF_ARCHITECTURES, config_from_gguf
from slipstream.loader.gguf_tokenizer import build_gguf_tokenizer
from slipstream.loader.tokenizer import Tokenizer
from slipstream.loader.weight_names import check_complete, expected_weight_names

Q = gguf.GGMLQuantizationType

_TOP_LEVEL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_PER_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Not model parameters: RoPE frequency factors (folded into the config).
_SKIPPED = {"rope_freqs.weight"}
# Arrays longer than this stay unread until the tokenizer needs them.
_LAZY_ARRAY = 1024


def hf_name(name: str) -> str | None:
    """GGUF tensor name -> Hugging Face parameter name (None if unknown)."""
    if name in _TOP_LEVEL:
        return _TOP_LEVEL[name]
    m = _LAYER_TENSOR.fullmatch(name)
    if m and m.group(2) in _PER_LAYER:
        return f"model.layers.{m.group(1)}.{_PER_LAYER[m.group(2)]}.{m.group(3)}"
    return None


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    # w: [n_head * head_dim, ...] interleaved pairs -> [n_head * head_dim, ...] rotate-half halves
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _open_reader(path: Path) -> gguf.GGUFReader:
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader fails in many ways on a damaged file
        raise ModelLoadError(f"{path}: not a readable GGUF file, truncated or corrupt ({type(e).__name__}: {e})") from None
    size = path.stat().st_size
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > size:
        raise ModelLoadError(f"{path}: truncated GGUF file: tensor data runs to byte {end}, the file has {size}")
    return reader


def _check_dequantizable(path: Path, tensors) -> None:
    for qtype in {t.tensor_type for t in tensors}:
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        try:
            gguf.quants.dequantize(np.zeros(type_size, dtype=np.uint8), qtype)
        except NotImplementedError:
            raise ModelLoadError(
                f"{path}: tensors are stored as {qtype.name}, which the gguf package cannot dequantize") from None


class GGUFModelFiles:
    """One GGUF file: config, weights and tokenizer all come from it."""

    def __init__(self, path: Path):
        self.path = path
        self._reader = _open_reader(path)
        fields = self._reader.fields
        self._meta = {k: f.contents() for k, f in fields.items() if len(f.data) <= _LAZY_ARRAY}
        if int(self._meta.get("split.count", 1)) > 1:
            raise ModelLoadError(
                f"{path}: a split GGUF file (part of {self._meta['split.count']}); merge the parts "
                "first with llama.cpp's `llama-gguf-split --merge`")
        self._tensors = {t.name: t for t in self._reader.tensors}
        rope_freqs = self._tensors.get("rope_freqs.weight")
        n_tokens = len(fields["tokenizer.ggml.tokens"].data) if "tokenizer.ggml.tokens" in fields else None
        self.config: ModelConfig = config_from_gguf(
            self._meta, set(self._tensors), n_tokens,
            None if rope_freqs is None else
            gguf.quants.dequantize(rope_freqs.data, rope_freqs.tensor_type).astype(np.float64).reshape(-1),
            where=str(path))
        # gguf name -> HF name, in file order
        self._names = {name: hf_name(name) for name in self._tensors if name not in _SKIPPED}
        unknown = [name for name, target in self._names.items() if target is None]
        if unknown:
            raise ModelLoadError(
                f"{path}: tensors slipstream does not know for a {self.config.architecture} model: "
                f"{', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''}")
        check_complete(set(self._names.values()), self.config, str(path))
        _check_dequantizable(path, self._tensors.values())
        self._permuted = GGUF_ARCHITECTURES[self._meta["general.architecture"]][1]

    def _tensor(self, name: str) -> torch.Tensor:
        t = self._tensors[name]
        shape = tuple(int(n) for n in reversed(t.shape))   # GGUF lists dims fastest first
        if t.tensor_type == Q.F32:
            out = torch.from_numpy(np.array(t.data, dtype=np.float32))
        elif t.tensor_type == Q.F16:
            out = torch.from_numpy(np.array(t.data, dtype=np.float16))
        elif t.tensor_type == Q.BF16:
            out = torch.from_numpy(np.array(t.data).view(np.int16)).view(torch.bfloat16)
        else:
            out = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type))
        return out.reshape(shape)

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        wanted = set(expected_weight_names(self.config))
        cfg = self.config
        for name, target in self._names.items():
            if target not in wanted:
                continue
            w = self._tensor(name)
            if self._permuted and ".attn_q." in name:
                w = _unpermute(w, cfg.num_attention_heads)
            elif self._permuted and ".attn_k." in name:
                w = _unpermute(w, cfg.num_key_value_heads)
            yield target, w

    def tokenizer(self) -> Tokenizer:
        fields = self._reader.fields
        meta = {k: (self._meta[k] if k in self._meta else f.contents())
                for k, f in fields.items() if k.startswith("tokenizer.")}
        return build_gguf_tokenizer(meta, str(self.path), self.config.eos_token_ids)

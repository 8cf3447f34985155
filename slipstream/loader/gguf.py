"""A GGUF model file: header parsed by `gguf_reader`, data memory-mapped.

Weights come out under Hugging Face names and in Hugging Face layout,
dequantized one tensor at a time as `weights()` is iterated (with the `gguf`
package's numpy code), so peak memory is the model in float plus one tensor.
A quantization scheme that runs GGUF blocks directly calls `keep_quantized`
first: the tensors it accepts then come out as `GGUFWeight`s, zero-copy views
of the file's blocks (q/k rows reordered, which copies those two).

Layout: llama.cpp's converter permutes the rows of attn_q / attn_k of `llama`
models from Hugging Face's rotate-half RoPE order to its interleaved order;
`_unpermute` undoes it (the same inverse transformers applies), per head group.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import gguf
import numpy as np
import torch

from slipstream.config import ModelConfig
from slipstream.errors import ModelLoadError
from slipstream.loader.gguf_config import GGUF_ARCHITECTURES, config_from_gguf
from slipstream.loader.gguf_reader import GGUFFile, TensorInfo
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


@dataclass(frozen=True)
class GGUFWeight:
    """A tensor left in GGUF blocks: data uint8 [rows, row_bytes], rows in HF order."""
    qtype: int                   # ggml type id
    data: object                 # torch.Tensor uint8 [rows, row_bytes]
    shape: tuple[int, int]       # the logical [rows, cols]


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
    # (rows gathered by index: also right for rows of GGUF blocks, whose bytes stay together)
    half = w.shape[0] // n_head // 2
    order = np.arange(w.shape[0]).reshape(n_head, half, 2).swapaxes(1, 2).reshape(-1)
    if w.dtype == torch.bfloat16:
        return w[torch.from_numpy(order)]
    return torch.from_numpy(w.numpy()[order])    # numpy: torch's row gather is slow on uint8


def _check_dequantizable(path: Path, qtypes: set[int]) -> None:
    for qtype in qtypes:
        block, type_size = gguf.GGML_QUANT_SIZES[Q(qtype)]
        try:
            gguf.quants.dequantize(np.zeros(type_size, dtype=np.uint8), Q(qtype))
        except NotImplementedError:
            raise ModelLoadError(
                f"{path}: tensors are stored as {Q(qtype).name}, which the gguf package cannot dequantize") from None


class GGUFModelFiles:
    """One GGUF file: config, weights and tokenizer all come from it."""

    def __init__(self, path: Path):
        self.path = path
        self._file = GGUFFile(path)
        self._meta = self._file.meta
        if int(self._meta.get("split.count", 1)) > 1:
            raise ModelLoadError(
                f"{path}: a split GGUF file (part of {self._meta['split.count']}); merge the parts "
                "first with llama.cpp's `llama-gguf-split --merge`")
        self._tensors = self._file.tensors
        rope_freqs = self._tensors.get("rope_freqs.weight")
        self.config: ModelConfig = config_from_gguf(
            self._meta, set(self._tensors), self._file.array_len("tokenizer.ggml.tokens"),
            None if rope_freqs is None else self._dequantize(rope_freqs).astype(np.float64).reshape(-1),
            where=str(path))
        # gguf name -> HF name, in file order
        self._names = {name: hf_name(name) for name in self._tensors if name not in _SKIPPED}
        unknown = [name for name, target in self._names.items() if target is None]
        if unknown:
            raise ModelLoadError(
                f"{path}: tensors slipstream does not know for a {self.config.architecture} model: "
                f"{', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''}")
        check_complete(set(self._names.values()), self.config, str(path))
        self._permuted = GGUF_ARCHITECTURES[self._meta["general.architecture"]][1]
        self._keep: Callable[[str, int], bool] = lambda name, qtype: False
        self._checked = False

    def tensor_types(self) -> dict[str, int]:
        """HF name -> ggml type id of each weight in the file."""
        return {target: self._tensors[name].type for name, target in self._names.items()}

    def keep_quantized(self, keep: Callable[[str, int], bool]) -> None:
        """`keep(hf_name, ggml type id)`: whether `weights()` yields that tensor as a GGUFWeight."""
        self._keep = keep

    def _dequantize(self, t: TensorInfo) -> np.ndarray:
        raw = self._file.raw(t).numpy()
        if t.type == Q.F32:
            return raw.view(np.float32).reshape(t.shape)
        if t.type == Q.F16:
            return raw.view(np.float16).reshape(t.shape)
        return gguf.quants.dequantize(raw, Q(t.type)).reshape(t.shape)

    def _tensor(self, name: str) -> torch.Tensor:
        t = self._tensors[name]
        if t.type == Q.BF16:
            return self._file.raw(t).view(torch.bfloat16).reshape(t.shape)
        return torch.from_numpy(self._dequantize(t))

    def weights(self) -> Iterator[tuple[str, torch.Tensor | GGUFWeight]]:
        wanted = set(expected_weight_names(self.config))
        cfg = self.config
        todo = [(name, target) for name, target in self._names.items() if target in wanted]
        if not self._checked:
            _check_dequantizable(self.path, {self._tensors[n].type for n, t in todo
                                             if not self._keep(t, self._tensors[n].type)})
            self._checked = True
        for name, target in todo:
            info = self._tensors[name]
            if self._keep(target, info.type) and len(info.shape) == 2:
                w = self._file.raw(info)
            else:
                w = self._tensor(name)
            if self._permuted and ".attn_q." in name:
                w = _unpermute(w, cfg.num_attention_heads)
            elif self._permuted and ".attn_k." in name:
                w = _unpermute(w, cfg.num_key_value_heads)
            if w.dtype == torch.uint8:
                w = GGUFWeight(info.type, w, info.shape)
            yield target, w

    def tokenizer(self) -> Tokenizer:
        meta = {k: self._file.value(k) for k in self._file.keys() if k.startswith("tokenizer.")}
        return build_gguf_tokenizer(meta, str(self.path), self.config.eos_token_ids)

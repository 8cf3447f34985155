"""Random weights (`load_format="dummy"`, vLLM's name): a model of real shape,
no weight files, so benchmarks run at real sizes.

The shape comes from one of:
  * a Hugging Face folder's config.json (weight files, if any, are not read;
    its tokenizer.json is used when present);
  * a GGUF file's metadata (its tokenizer too; tensors are not read);
  * a Llama-family preset of the analysis layer (`slipstream/analysis/presets.py`),
    e.g. "llama-3-8b", "qwen2.5-72b", "llama-2-70b".
Without a tokenizer (a preset) the engine gets `IdTokenizer`, a stand-in whose
text is token ids written as decimal numbers separated by spaces: prompts
given as `{"prompt_token_ids": [...]}` run as usual, output text is the ids,
and text prompts must be ids ("12 7 4051"). It has no EOS, so generation stops
at max_tokens or the context limit.

The weights are created on the target device, in the model dtype, by
`initialize_dummy_weights`: every floating-point parameter is filled in place
from a seeded generator on that device (uniform in [-scale, scale], std about
0.02 as Hugging Face initialises Llama; norm weights 1 plus the same small
noise), so activations stay finite through many layers and an 8B model fills
in well under a second on a GPU.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator

import tokenizers
import torch
from torch import nn

from slipstream.config import ModelConfig
from slipstream.errors import ModelLoadError
from slipstream.loader.tokenizer import Tokenizer

LOAD_FORMATS = ("auto", "dummy")
DUMMY_SCALE = 0.035   # uniform(-a, a) has std a / sqrt(3): 0.02

# Presets of the analysis layer that the Llama implementation can build, with
# what a ModelSpec does not record: (architecture, rope theta, context length).
_PRESET_EXTRAS = {
    "llama-3-8b": ("llama", 500000.0, 8192),
    "llama-3.1-405b": ("llama", 500000.0, 131072),
    "llama-2-70b": ("llama", 10000.0, 4096),
    "qwen2.5-72b": ("qwen2", 1000000.0, 32768),
}


class DummyWeights:
    """Stands in for a checkpoint's tensor stream: `load_into(model)` fills the
    model's parameters in place instead of copying tensors into them."""

    def __init__(self, seed: int = 0, scale: float = DUMMY_SCALE):
        self.seed, self.scale = seed, scale

    def load_into(self, model: nn.Module) -> None:
        initialize_dummy_weights(model, self.seed, self.scale)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        raise ModelLoadError("dummy weights are not a tensor stream; call load_into(model)")


@torch.no_grad()
def initialize_dummy_weights(model: nn.Module, seed: int = 0, scale: float = DUMMY_SCALE) -> None:
    """Fill every floating-point parameter of `model` in place, on its own device
    and in its own dtype, then let the linear layers' quant methods post-process."""
    gens: dict[torch.device, torch.Generator] = {}
    seen: set[int] = set()
    # named_parameters' order (a tied weight is listed once), with each owner at hand.
    for mname, module in model.named_modules():
        for _, p in module.named_parameters(recurse=False):
            if id(p) in seen or not p.is_floating_point():
                continue
            seen.add(id(p))
            g = gens.get(p.device)
            if g is None:
                g = gens[p.device] = torch.Generator(device=p.device).manual_seed(seed)
            # A tensor-parallel rank draws the whole tensor (the same numbers as one
            # process) and keeps its slice: TP=N runs the model TP=1 runs.
            # (Through the layer's loader even where the shapes agree: a row-parallel
            # bias is whole on rank 0 and zero elsewhere.)
            sharded = getattr(module, "tp_size", 1) > 1 and hasattr(module, "whole_shape")
            t = torch.empty(module.whole_shape(p), dtype=p.dtype, device=p.device) if sharded else p
            t.uniform_(-scale, scale, generator=g)
            if "norm" in mname.rsplit(".", 1)[-1]:
                t.add_(1.0)   # RMSNorm weights around 1
            if t is not p:
                p.weight_loader(p, t)
    from slipstream.layers.linear import LinearBase
    for module in model.modules():
        if isinstance(module, LinearBase):
            module.quant_method.process_after_loading(module)


class IdTokenizer(Tokenizer):
    """A stand-in for a model without a tokenizer: token i is the text "i"."""

    def __init__(self, vocab_size: int, source: str):
        vocab = {str(i): i for i in range(vocab_size)}
        backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="0"))
        backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
        super().__init__(backend, bos_token_id=None, eos_token_ids=(), add_bos=False,
                         source=f"{source} (no tokenizer: text is token ids)")
        self._vocab_size = vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        words = text.split()
        if not all(re.fullmatch(r"\d+", w) and int(w) < self._vocab_size for w in words):
            raise ValueError(f"prompt: {self.source} reads only token ids separated by spaces "
                             f"(each below {self._vocab_size}); or pass prompt_token_ids")
        return [int(w) for w in words]


class DummyModelFiles:
    """`ModelFiles` for load_format="dummy": a config, a tokenizer, random weights."""

    def __init__(self, path: Path, config: ModelConfig, tokenizer=None, seed: int = 0):
        self.path, self.config = path, config
        self._tokenizer, self._seed = tokenizer, seed

    def weights(self) -> DummyWeights:
        return DummyWeights(self._seed)

    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            self._tokenizer = IdTokenizer(self.config.vocab_size, str(self.path))
        return self._tokenizer


def open_dummy(model: str | Path, seed: int = 0) -> DummyModelFiles:
    """A model folder (config.json), a GGUF file or a preset name -> DummyModelFiles."""
    path = Path(model).expanduser()
    if path.is_dir():
        from slipstream.loader.safetensors import _model_config
        from slipstream.loader.tokenizer import load_hf_tokenizer
        config = _model_config(path)
        tok = load_hf_tokenizer(path, config.eos_token_ids) \
            if (path / "tokenizer.json").is_file() else None
        return DummyModelFiles(path, config, tok, seed)
    if path.is_file():
        from slipstream.loader import is_gguf
        if not is_gguf(path):
            raise ModelLoadError(f"{path}: load_format='dummy' needs a model folder with a "
                                 "config.json, a GGUF file or a preset name")
        from slipstream.loader.gguf import GGUFModelFiles
        files = GGUFModelFiles(path)
        return DummyModelFiles(path, files.config, files.tokenizer(), seed)
    return DummyModelFiles(Path(str(model)), preset_config(str(model)), None, seed)


def preset_config(name: str) -> ModelConfig:
    """The ModelConfig of a Llama-family preset of the analysis layer."""
    from slipstream.analysis.presets import PRESETS, resolve_model
    try:
        spec = resolve_model(name)
    except ValueError:
        spec = None
    if spec is None or spec.name not in PRESETS:
        raise ModelLoadError(f"model {name!r} is neither a path nor a preset; with "
                             f"load_format='dummy' a preset may be one of {sorted(_PRESET_EXTRAS)}")
    if spec.name not in _PRESET_EXTRAS:
        raise ModelLoadError(f"preset {spec.name!r} is not a Llama-family shape this engine "
                             f"builds (MoE, MLA, q/k norms); use one of {sorted(_PRESET_EXTRAS)}")
    arch, theta, context = _PRESET_EXTRAS[spec.name]
    return ModelConfig(
        architecture=arch, vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim, max_position_embeddings=context, rope_theta=theta,
        tie_word_embeddings=spec.tie_word_embeddings, attention_bias=spec.attention_bias,
        sliding_window=spec.window)


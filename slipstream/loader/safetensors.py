"""A Hugging Face model folder: config.json, safetensors weights, tokenizer.json.

Only safetensors are read (`safe_open`: a JSON header and raw tensor bytes,
nothing executed). Pickle checkpoints (`*.bin`, `*.pt`) are refused, since
unpickling a file can run arbitrary code. Every header is parsed when the
folder is opened, so a truncated or corrupt shard fails at once, not midway
through loading.
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Iterator

import torch
from safetensors import SafetensorError, safe_open

from slipstream.config import ModelConfig
from slipstream.errors import ModelLoadError
from slipstream.loader.json_file import read_json
from slipstream.loader.tokenizer import Tokenizer, load_hf_tokenizer
from slipstream.loader.weight_names import check_complete, expected_weight_names
from slipstream.models.hf_config import model_config_from_hf

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Stored but not parameters: old checkpoints save RoPE's inverse frequencies.
_IGNORED = re.compile(r".*\.rotary_emb\.inv_freq")


def _model_config(folder: Path) -> ModelConfig:
    path = folder / "config.json"
    cfg = read_json(path)
    try:
        config = model_config_from_hf(cfg)
    except ModelLoadError as e:
        raise ModelLoadError(f"{path}: {e}") from None
    except KeyError as e:
        raise ModelLoadError(f"{path}: missing the field {e.args[0]!r}") from None
    except (ValueError, TypeError) as e:
        raise ModelLoadError(f"{path}: {e}") from None
    gen = folder / "generation_config.json"
    if gen.is_file():   # generation_config.json may list more stop ids (e.g. Llama 3's <|eot_id|>)
        eos = read_json(gen).get("eos_token_id")
        more = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
        ids = tuple(dict.fromkeys([*config.eos_token_ids, *more]))
        config = dataclasses.replace(config, eos_token_ids=ids)
    return config


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index}: has no weight_map")
        files = [folder / name for name in dict.fromkeys(weight_map.values())]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index} names shard(s) that are not in the folder: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    if pickles:
        raise ModelLoadError(
            f"{folder}: holds only pickle checkpoints ({', '.join(pickles[:3])}); slipstream accepts "
            "safetensors or GGUF weights only, since unpickling can run code. Convert them, e.g. "
            "with transformers: model.save_pretrained(folder, safe_serialization=True)")
    raise ModelLoadError(f"{folder}: no weights found (expected model.safetensors or a sharded "
                         "model.safetensors.index.json)")


def _read_header(path: Path) -> list[str]:
    try:
        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())
    except (SafetensorError, OSError) as e:
        raise ModelLoadError(f"{path}: not a readable safetensors file, truncated or corrupt ({e})") from None


class HFModelFiles:
    """A folder written by transformers' save_pretrained (or downloaded from the Hub)."""

    def __init__(self, folder: Path):
        self.path = folder
        if not (folder / "config.json").is_file():
            ggufs = sorted(folder.glob("*.gguf"))
            hint = f"; for GGUF, pass the file itself: {ggufs[0]}" if ggufs else ""
            raise ModelLoadError(f"{folder}: no config.json, so this is not a Hugging Face model folder{hint}")
        self.config: ModelConfig = _model_config(folder)
        # A quantized checkpoint stores other tensors (qweight, scales, ...) than a float
        # one; its quantization scheme names them and model.load_weights checks them all.
        self.quantization_config: dict | None = read_json(folder / "config.json").get(
            "quantization_config")
        self._files = {path: _read_header(path) for path in _weight_files(folder)}
        if self.quantization_config:
            return
        available = {n for names in self._files.values() for n in names}
        check_complete(available, self.config, str(folder))
        # A tensor the model has no place for (an MLP bias, say) means the model
        # would silently compute something else than the checkpoint's.
        extra = sorted(n for n in available - set(expected_weight_names(self.config))
                       if not _IGNORED.fullmatch(n)
                       and not (n == "lm_head.weight" and self.config.tie_word_embeddings))
        if extra:
            raise ModelLoadError(
                f"{folder}: the checkpoint holds tensors a {self.config.architecture} model has no "
                f"place for: {', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}")

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        wanted = set(expected_weight_names(self.config))
        quantized = bool(self.quantization_config)
        for path, names in self._files.items():
            try:
                with safe_open(str(path), framework="pt") as f:
                    for name in names:
                        if name not in wanted and not (quantized and not _IGNORED.fullmatch(name)):
                            continue   # e.g. rotary inv_freq buffers, or lm_head of a tied model
                        tensor = f.get_tensor(name)
                        if tensor.dtype not in _FLOAT_DTYPES and not quantized:
                            raise ModelLoadError(
                                f"{path}: tensor {name} is {tensor.dtype}; slipstream reads float "
                                "checkpoints (float32, float16, bfloat16) only")
                        yield name, tensor
            except SafetensorError as e:
                raise ModelLoadError(f"{path}: corrupt safetensors file ({e})") from None

    def tokenizer(self) -> Tokenizer:
        return load_hf_tokenizer(self.path, self.config.eos_token_ids)

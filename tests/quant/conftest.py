"""A tiny random Llama checkpoint on disk (hidden 256, so group 128 divides every layer)."""
from __future__ import annotations

import pytest
import torch

from tests.engine.conftest import build_hf_model, make_llm  # noqa: F401
from tests.loader.checkpoints import write_hf_tokenizer


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("quant-llama")
    model = build_hf_model("llama")
    model.save_pretrained(folder)
    write_hf_tokenizer(folder)
    return folder


def prompt_logprobs(llm, prompts) -> torch.Tensor:
    """Log-prob of each prompt token after the first: [num_prompts, len - 1]."""
    from slipstream import SamplingParams
    sp = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    return torch.tensor([[pos[t].logprob for pos, t in zip(o.prompt_logprobs[1:],
                                                          o.prompt_token_ids[1:])]
                         for o in outs])


def random_prompts(n: int = 3, length: int = 40, vocab: int = 265, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(3, vocab, (length,), generator=g).tolist()}
            for _ in range(n)]

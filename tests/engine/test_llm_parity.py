"""The whole path (loader, engine, runner, sampler) against transformers, fp32."""
import pytest
import torch

from slipstream import SamplingParams
from tests.engine.conftest import make_llm, random_prompts

TOL = 1e-4


@pytest.mark.parametrize("arch,tie", [("llama", False), ("llama", True), ("qwen2", False), ("mistral", False)])
def test_prompt_and_sample_logprobs_match_transformers(tiny_folder, arch, tie):
    folder, hf = tiny_folder(arch, tie)
    # Chunked prefill and a small block size so paging and chunks are exercised.
    llm = make_llm(folder, max_num_batched_tokens=16)
    prompts = random_prompts(3, hf.config.vocab_size, 20, 70, seed=1)
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=3, prompt_logprobs=3)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ids = prompt["prompt_token_ids"] + out.outputs[0].token_ids
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
        n = len(prompt["prompt_token_ids"])
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == n
        for pos in range(1, n):
            entry = out.prompt_logprobs[pos]
            tok = ids[pos]
            assert abs(entry[tok].logprob - ref[pos - 1, tok].item()) < TOL
            top = torch.topk(ref[pos - 1], 3)
            for r, (v, i) in enumerate(zip(top.values.tolist(), top.indices.tolist()), 1):
                assert entry[i].rank == r and abs(entry[i].logprob - v) < TOL
        for j, tok in enumerate(out.outputs[0].token_ids):
            row = ref[n - 1 + j]
            assert tok == int(row.argmax())  # greedy
            assert abs(out.outputs[0].logprobs[j][tok].logprob - row[tok].item()) < TOL
            assert out.outputs[0].logprobs[j][tok].rank == 1

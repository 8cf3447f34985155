"""The default model (Q4_1 GGUF) through slipstream against transformers' own
GGUF loading of the same file: same next-token distributions, fp32."""
import pytest
import torch

from slipstream import LLM, SamplingParams
from slipstream.loader import default_model_path

PROMPTS = ["The capital of France is", "def add(a, b):\n    return",
           "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n",
           "1, 1, 2, 3, 5, 8,"]


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    path = default_model_path()
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    return model


def test_next_token_distribution_matches_transformers(hf_model):
    llm = LLM(dtype="float32", device="cpu", max_model_len=256, quantization=None)   # dequantized
    tok = llm.get_tokenizer()
    for text in PROMPTS:
        ids = tok.encode(text)
        out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, temperature=0, logprobs=20),
                           use_tqdm=False)[0].outputs[0]
        with torch.no_grad():
            ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0, -1].float(), -1)
        top = torch.topk(ref, 20)
        assert out.token_ids[0] == top.indices[0].item()
        got = out.logprobs[0]
        for rank, (i, v) in enumerate(zip(top.indices.tolist(), top.values.tolist()), 1):
            assert got[i].rank == rank
            assert abs(got[i].logprob - v) < 1e-4, (text, i)

"""GGUF blocks kept at run time on the CPU (quant/gguf.py): the same model as
the dequantized path, up to the int8 rounding of activations the kernels do
(as llama.cpp does), with the weights left in the memory-mapped file."""
import pytest
import torch

from slipstream import LLM, SamplingParams
from slipstream.kernels import cpu_library
from slipstream.kernels.cpu_quant import QuantMatrix

from tests.loader.checkpoints import Q, write_gguf

needs_kernels = pytest.mark.skipif(cpu_library.load() is None, reason="no C compiler for the CPU kernels")

PROMPTS = ["The capital of France is", "def add(a, b):\n    return",
           "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n",
           "1, 1, 2, 3, 5, 8,"]


def _next_token(llm, text, k=20):
    p = SamplingParams(max_tokens=1, temperature=0, logprobs=k)
    return llm.generate([text], p, use_tqdm=False)[0].outputs[0]


@needs_kernels
def test_default_model_quantized_matches_dequantized():
    """Next-token log-probs of the default model (Q4_1 blocks, Q8_0 embedding) through the
    kernels against the dequantized fp32 path. Measured: the greedy token agrees, the top
    log-prob moves by at most 0.18, the top-20 by 0.07 on average (int8 activations
    through 30 layers: a relative 1e-7 nudge of the embeddings alone moves top-10
    log-probs by up to 0.27, see test_cpu_decoder.py; dequantized weights with fp32
    activations agree exactly)."""
    quant = LLM(dtype="float32", device="cpu", max_model_len=256, quantization="gguf")
    dense = LLM(dtype="float32", device="cpu", max_model_len=256, quantization=None)
    assert isinstance(quant.engine.runner.model.model.layers[0].mlp.down_proj.gguf_weight, QuantMatrix)
    for text in PROMPTS:
        a, b = _next_token(quant, text), _next_token(dense, text)
        assert a.token_ids == b.token_ids, text
        la, lb = a.logprobs[0], b.logprobs[0]
        top = b.token_ids[0]
        assert abs(la[top].logprob - lb[top].logprob) < 0.3, text
        common = set(la) & set(lb)
        assert len(common) >= 15
        mean = sum(abs(la[i].logprob - lb[i].logprob) for i in common) / len(common)
        assert mean < 0.2, (text, mean)


@needs_kernels
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=lambda q: q.name)
@pytest.mark.parametrize("tie", [False, True])
def test_tiny_model_quantized_matches_dequantized(tmp_path, tiny_model, qtype, tie):
    path = write_gguf(tmp_path / "m.gguf", tiny_model("llama", tie=tie), qtype)
    quant = LLM(model=str(path), dtype="float32", device="cpu", quantization="gguf")
    dense = LLM(model=str(path), dtype="float32", device="cpu", quantization=None)
    model = quant.engine.runner.model
    # weights are the file's blocks, in place: nothing was dequantized at load
    assert isinstance(model.model.layers[1].self_attn.qkv_proj.gguf_weight, QuantMatrix)
    assert model.lm_head.quant_method is not None
    ids = list(range(3, 40))
    p = SamplingParams(max_tokens=4, temperature=0, logprobs=5, ignore_eos=True)
    a = quant.generate({"prompt_token_ids": ids}, p, use_tqdm=False)[0].outputs[0]
    b = dense.generate({"prompt_token_ids": ids}, p, use_tqdm=False)[0].outputs[0]
    for la, lb in zip(a.logprobs, b.logprobs):
        for i in set(la) & set(lb):
            assert abs(la[i].logprob - lb[i].logprob) < 0.05


def test_without_a_compiler_the_weights_are_dequantized(tmp_path, tiny_model, monkeypatch):
    """No C compiler: `auto` keeps the dense path, `gguf` dequantizes at load."""
    from slipstream.quant import gguf as scheme
    monkeypatch.setattr(cpu_library, "load", lambda: None)
    path = write_gguf(tmp_path / "m.gguf", tiny_model("llama"), Q.Q8_0)
    assert not scheme.runs_quantized(str(path), torch.device("cpu"))
    llm = LLM(model=str(path), device="cpu", dtype="float32", quantization="gguf")
    w = llm.engine.runner.model.model.layers[0].mlp.down_proj.gguf_weight
    assert isinstance(w, torch.Tensor) and w.dtype == torch.float32
    ref = LLM(model=str(path), device="cpu", dtype="float32", quantization=None)
    p = SamplingParams(max_tokens=3, temperature=0, logprobs=3, ignore_eos=True)
    a = llm.generate({"prompt_token_ids": [3, 4, 5]}, p, use_tqdm=False)[0].outputs[0]
    b = ref.generate({"prompt_token_ids": [3, 4, 5]}, p, use_tqdm=False)[0].outputs[0]
    assert a.token_ids == b.token_ids
    assert a.logprobs[0][a.token_ids[0]].logprob == pytest.approx(b.logprobs[0][b.token_ids[0]].logprob, abs=1e-5)


@needs_kernels
def test_auto_on_the_cpu_is_fp32_over_blocks():
    llm = LLM(device="cpu", max_model_len=128)
    assert llm.engine.config.dtype == torch.float32
    assert isinstance(llm.engine.runner.model.model.embed_tokens.gguf_weight, QuantMatrix)

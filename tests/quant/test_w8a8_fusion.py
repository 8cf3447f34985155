"""W8A8 with the per-token quantization fused into the producers of the layers' inputs
(add + RMSNorm before qkv / gate_up, SiLU * up before down; quant/activation.py): the
model wires it only where a W8A8 layer follows, and the fused path scores prompts as the
unfused one does, on the torch path (identical codes) and through the Triton kernels
(TRITON_INTERPRET=1 on the CPU; a code may move one step at a rounding tie)."""
import pytest
import torch

from slipstream.layers.activation import SiluAndMul
from slipstream.layers.norm import RMSNorm
from slipstream.quant.activation import QuantizedRows, quantize_activation
from tests.quant.conftest import make_llm, prompt_logprobs, random_prompts


def _producers(llm):
    return [m for m in llm.engine.runner.model.modules() if isinstance(m, (RMSNorm, SiluAndMul))]


@pytest.mark.parametrize("scheme,kind", [("w8a8", "int8"), ("fp8", "fp8")])
def test_fusion_wiring_and_same_scores(tiny_llama, monkeypatch, scheme, kind):
    fused = make_llm(tiny_llama, quantization=scheme)
    prods = _producers(fused)
    quant = [m.quant for m in prods]
    # Every layer's two norms and its SiLU; the final norm (LM head: dense) stays plain.
    layers = len(fused.engine.runner.model.model.layers)
    assert quant.count(kind) == 3 * layers and quant.count(None) == 1
    got = prompt_logprobs(fused, random_prompts())
    monkeypatch.setenv("SLIPSTREAM_W8A8_FUSE", "0")
    plain = make_llm(tiny_llama, quantization=scheme)
    assert all(m.quant is None for m in _producers(plain))
    torch.testing.assert_close(got, prompt_logprobs(plain, random_prompts()), atol=0, rtol=0)


def test_dense_model_has_no_fused_quantization(tiny_llama):
    assert all(m.quant is None for m in _producers(make_llm(tiny_llama)))


def test_fused_kernels_in_the_model(tiny_llama):
    """The norms and SiLU forced onto their Triton kernels (with the fused quantization)
    against their torch path, in a W8A8 int8 model."""
    llm = make_llm(tiny_llama, quantization="w8a8")
    want = prompt_logprobs(llm, random_prompts(n=2, length=24))
    for m in _producers(llm):
        m.use_kernel = True
    try:
        got = prompt_logprobs(llm, random_prompts(n=2, length=24))
    finally:
        for m in _producers(llm):
            m.use_kernel = None
    assert 0 < (got - want).abs().max() < 2e-2   # 0 would mean the kernels never ran


def test_quantize_activation():
    x = torch.randn(5, 64)
    r = quantize_activation(x, "int8")
    assert isinstance(r, QuantizedRows) and r.shape == (5, 64) and r.dtype == torch.float32
    assert r.q.dtype == torch.int8 and r.scale.shape == (5, 1)
    torch.testing.assert_close(r.q.float() * r.scale, x, atol=r.scale.max().item(), rtol=0)
    with pytest.raises(ValueError, match="kind"):
        quantize_activation(x, "int4")

"""`LLM(model, quantization=...)` on a tiny random Llama: each scheme loads a float
checkpoint, quantizes it, and scores prompts close to the dense model.

Tolerances are mean |log-prob difference| over 117 prompt positions of a model whose
next-token distributions are peaked (weights ~ N(0, 0.08)); measured at the time of
writing: int8 0.04, w8a8 0.06, fp8 0.18, rtn-int4 0.46, rtn-int3 0.76."""
import pytest
import torch

from slipstream.quant import primitives as P
from tests.quant.conftest import make_llm, prompt_logprobs, random_prompts

TOL = {"int8": 0.1, "w8a8": 0.15, "fp8": 0.35, "rtn-int4": 0.8, "rtn-int3": 1.2}


@pytest.fixture(scope="module")
def dense(tiny_llama):
    return prompt_logprobs(make_llm(tiny_llama), random_prompts())


@pytest.mark.parametrize("scheme", list(TOL))
def test_scheme_scores_close_to_dense(tiny_llama, dense, scheme):
    llm = make_llm(tiny_llama, quantization=scheme)
    lp = prompt_logprobs(llm, random_prompts())
    assert (lp - dense).abs().mean() < TOL[scheme]
    names = {type(m.quant_method).__name__ for m in llm.engine.runner.model.modules()
             if getattr(m, "quant_method", None) is not None}
    assert names == {{"int8": "IntWeightMethod", "rtn-int4": "IntWeightMethod",
                      "rtn-int3": "IntWeightMethod", "fp8": "Fp8Method",
                      "w8a8": "Int8W8A8Method"}[scheme]}
    from slipstream.commands.options import weights_summary
    summary, cpu_kernels = weights_summary(llm.engine.runner.model, scheme)
    assert summary.startswith(f"{scheme}: ") and summary != f"{scheme}: "
    blocks = any(getattr(m, "cpu_blocks", None) is not None for m in llm.engine.runner.model.modules())
    assert cpu_kernels == blocks        # the load line then counts the kernels' threads
    assert weights_summary(make_llm(tiny_llama).engine.runner.model, None) == ("dense", False)


def test_rtn_int4_equals_the_dense_model_on_fake_quantized_weights(tiny_llama, tmp_path,
                                                                    monkeypatch):
    """The quantized layers compute exactly what dense layers holding the dequantized
    weights compute: the whole difference to dense is the rounding of the weights (with
    the CPU's GGUF-block products off: they also round the activations to int8,
    tests/quant/test_cpu_blocks.py)."""
    monkeypatch.setenv("SLIPSTREAM_CPU_BLOCKS", "0")
    import shutil
    from safetensors.torch import load_file, save_file
    folder = tmp_path / "fake"
    shutil.copytree(tiny_llama, folder)
    sd = load_file(str(tiny_llama / "model.safetensors"))
    proj = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    for name, w in sd.items():
        if any(p in name for p in proj):
            sd[name] = P.fake_quantize(w.float(), 4, False, "group", 128).to(w.dtype)
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    fake = prompt_logprobs(make_llm(folder), random_prompts())
    quant = prompt_logprobs(make_llm(tiny_llama, quantization="rtn-int4"), random_prompts())
    torch.testing.assert_close(quant, fake, atol=2e-4, rtol=0)


def test_errors_order_by_precision(tiny_llama, dense):
    err = {s: (prompt_logprobs(make_llm(tiny_llama, quantization=s), random_prompts()) - dense)
           .abs().mean().item() for s in ("int8", "rtn-int4", "rtn-int3")}
    assert err["int8"] < err["rtn-int4"] < err["rtn-int3"]


def test_unknown_scheme_names_the_option(tiny_llama):
    with pytest.raises(ValueError, match="quantization"):
        make_llm(tiny_llama, quantization="int5")


@pytest.mark.parametrize("scheme,body", [("rtn-int4-head8", "rtn-int4"), ("int8-head8", "int8")])
def test_head8_schemes_quantize_the_untied_lm_head(tiny_llama, dense, scheme, body):
    """rtn-int4 / int8 plus an int8 LM head: the head is quantized on its first product
    (the model's own loaders post-process only linear layers), per output channel; the
    scores stay as close to dense as the body scheme's, and the embedding stays dense."""
    llm = make_llm(tiny_llama, quantization=scheme)
    model = llm.engine.runner.model
    lp = prompt_logprobs(llm, random_prompts())
    head = model.lm_head
    assert type(head.quant_method).__name__ == "IntWeightHeadMethod"
    assert not hasattr(head, "weight")
    if hasattr(head, "cpu_blocks"):     # the CPU kernels' Q8_0 blocks (quant/cpu_blocks.py)
        qm = head.cpu_blocks
        assert qm.segments[0][0] == 8 and (qm.rows, qm.cols) == (head.vocab_size, head.hidden_size)
    else:
        assert head.qweight.dtype == torch.uint8
        assert head.qweight.shape == (head.vocab_size, head.hidden_size)  # 8 bits: one per byte
    assert model.model.embed_tokens.quant_method is None
    base = prompt_logprobs(make_llm(tiny_llama, quantization=body), random_prompts())
    assert (lp - base).abs().mean() < 0.1 and (lp - dense).abs().mean() < TOL[body]
    with pytest.raises(ValueError, match="embedding"):
        head.quant_method.embedding(head, torch.zeros(1, dtype=torch.long))

"""Weight-only codes on the CPU as GGUF blocks (quant/cpu_blocks.py): the blocks hold
the same weights up to the scales' fp16 rounding, the engine's layers multiply through
the CPU kernels (activations rounded to int8 per block of 32) and the one-call decode
step serves them."""
import pytest
import torch

from slipstream.kernels import cpu_decoder, cpu_library, cpu_reference
from slipstream.quant.cpu_blocks import Q4_1, Q8_0, representable, to_gguf_blocks
from tests.quant.conftest import make_llm, prompt_logprobs, random_prompts

needs_kernels = pytest.mark.skipif(cpu_library.load() is None, reason="no C compiler")


@pytest.mark.parametrize("bits,sym,group", [(4, False, 128), (4, True, 64), (8, True, 256),
                                            (4, False, 96)])
def test_blocks_hold_the_dequantized_weights(bits, sym, group):
    rows, cols = 24, 256
    g = torch.Generator().manual_seed(bits + group)
    groups = -(-cols // group)
    codes = torch.randint(0, 2 ** bits, (rows, cols), generator=g).to(torch.uint8)
    scales = torch.rand(rows, groups, generator=g) * 0.02 + 1e-3
    zeros = None if sym else torch.randint(0, 16, (rows, groups), generator=g).to(torch.uint8)
    z = torch.full_like(scales, 2.0 ** (bits - 1)) if sym else zeros.float()
    col_group = torch.arange(cols) // group
    want = (codes.float() - z[:, col_group]) * scales[:, col_group]
    qtype, data = to_gguf_blocks(codes, scales, zeros, bits, group)
    assert qtype == (Q4_1 if bits == 4 else Q8_0)
    got = cpu_reference.dequantize(qtype, data, cols)
    # scale and offset (-zero x scale) each rounded to fp16: half an ulp (2^-11, relative)
    # of at most 2^bits x scale apiece
    assert (got - want).abs().max() <= 2 * 2 ** -11 * 2 ** bits * scales.max()
    assert (got - want).abs().max() > 0 or bits == 8      # the rounding is there to see


def test_formats_without_blocks():
    assert not representable(3, False, 256, 128)         # 3 bits
    assert not representable(8, False, 256, 128)         # asymmetric 8 bits: code - zero > 127
    assert not representable(4, False, 256, 48)          # groups not whole 32-blocks
    assert not representable(4, False, 80, 80)           # rows not whole 32-blocks
    assert to_gguf_blocks(torch.zeros(2, 256, dtype=torch.uint8), torch.ones(2, 2), None, 3,
                          128) is None


@needs_kernels
@pytest.mark.parametrize("scheme", ["rtn-int4", "int8"])
def test_engine_layers_run_on_blocks(tiny_llama, scheme, monkeypatch):
    """Every weight-only layer holds blocks; the scores stay near the exact products
    (the difference is int8 activations), and greedy decoding by the one-call step equals
    the model's own forward token for token."""
    from slipstream import SamplingParams
    llm = make_llm(tiny_llama, quantization=scheme)
    layers = [m for m in llm.engine.runner.model.modules()
              if type(getattr(m, "quant_method", None)).__name__ == "IntWeightMethod"]
    assert layers and all(m.gguf_weight is m.cpu_blocks for m in layers)
    lp = prompt_logprobs(llm, random_prompts())
    monkeypatch.setenv("SLIPSTREAM_CPU_BLOCKS", "0")
    exact_llm = make_llm(tiny_llama, quantization=scheme)
    assert not any(hasattr(m, "cpu_blocks") for m in exact_llm.engine.runner.model.modules())
    exact = prompt_logprobs(exact_llm, random_prompts())
    assert (lp - exact).abs().mean() < 0.05
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = random_prompts(n=2, length=9, seed=1)
    fused = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert llm.engine.runner.model.model.cpu_decoder, "the one-call decode step took no part"
    monkeypatch.setattr(cpu_decoder, "enabled", False)
    plain = [o.outputs[0].token_ids for o in make_llm(tiny_llama, quantization=scheme).generate(
        prompts, sp, use_tqdm=False)]
    assert fused == plain


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_lm_head_in_the_kernels_pool(monkeypatch, dtype):
    """Where the kernels' pool holds the threads, a dense LM head multiplies there (the
    table read in place): the logits of F.linear, up to the order of the fp32 sums."""
    from slipstream.layers.embedding import LMHead
    head = LMHead(300, 64).to(dtype)
    torch.nn.init.normal_(head.weight, std=0.1)
    h = torch.randn(5, 64).to(dtype)
    monkeypatch.setattr(cpu_library, "took_threads", False)
    want = head(h)
    assert head._cpu_table(h) is None
    monkeypatch.setattr(cpu_library, "took_threads", True)
    got = head(h)
    assert head._cpu_table(h) is not None and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 if dtype == torch.float32 else 2e-2)


@needs_kernels
def test_auto_dtype_is_fp32_where_layers_run_on_blocks(tiny_llama, monkeypatch):
    """dtype=auto on the CPU: float32 for weight-only schemes that take the blocks (the
    kernels and the one-call step read fp32), the usual choice otherwise."""
    from slipstream.config import resolve_dtype
    from slipstream.engine.args import EngineArgs
    from slipstream.loader import open_model
    files = open_model(str(tiny_llama))
    cfg = lambda **kw: EngineArgs(model=str(tiny_llama), device="cpu", **kw).create_config(  # noqa: E731
        str(tiny_llama), files.config)
    assert cfg(quantization="rtn-int4").dtype == torch.float32
    assert cfg(quantization="fp8").dtype == resolve_dtype("auto", torch.device("cpu"))
    assert cfg(quantization="rtn-int4", dtype="bfloat16").dtype == torch.bfloat16
    monkeypatch.setenv("SLIPSTREAM_CPU_BLOCKS", "0")
    assert cfg(quantization="rtn-int4").dtype == resolve_dtype("auto", torch.device("cpu"))

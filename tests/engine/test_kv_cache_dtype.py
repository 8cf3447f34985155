"""`kv_cache_dtype`: the engine with an int8 / fp8 KV cache (codes + a scale per
token and head) on a tiny random Llama: the pool holds codes, its sizing counts
the smaller bytes per token, and the model's log-probs stay near the 16-bit
cache's through both attention backends (torch: reference; triton: the kernels
under the interpreter)."""

import pytest
import torch

from slipstream import SamplingParams
from slipstream.engine.args import EngineArgs
from slipstream.quant.kv_quant import fake_quantize_kv
from tests.engine.conftest import make_llm

PROMPTS = [{"prompt_token_ids": [5, 9, 13, 2, 7, 11, 3, 8, 20, 4, 6]},
           {"prompt_token_ids": [17, 3, 3, 9]}]


def _prompt_logprobs(llm, max_tokens=6):
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, prompt_logprobs=0, logprobs=0)
    outs = llm.generate(PROMPTS, sp, use_tqdm=False)
    lps, gen = [], []
    for o in outs:
        lps += [pos[t].logprob for pos, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])]
        gen += [pos[t].logprob for pos, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
    return torch.tensor(lps), [o.outputs[0].token_ids for o in outs], torch.tensor(gen)


@pytest.fixture(scope="module")
def baseline(tiny_folder):
    folder, _ = tiny_folder("llama")
    return _prompt_logprobs(make_llm(folder))


def _simulated(folder, kv):
    """The 16-bit engine with every stored K/V replaced by what the quantized cache
    hands back (quant/kv_quant.py's reference quantizer)."""
    llm = make_llm(folder)
    for layer in llm.engine.runner.model.attention_layers():
        forward = layer.forward

        def quantized(q, k, v, batch, forward=forward):
            return forward(q, fake_quantize_kv(k, kv), fake_quantize_kv(v, kv), batch)
        layer.forward = quantized
    return _prompt_logprobs(llm)


@pytest.mark.parametrize("kv,tol", [("int8", 0.1), ("fp8", 0.3)])
def test_torch_backend_reads_quantized_cache(tiny_folder, baseline, kv, tol):
    folder, _ = tiny_folder("llama")
    llm = make_llm(folder, kv_cache_dtype=kv)
    runner = llm.engine.runner
    assert runner.kv_cache.dtype == {"int8": torch.int8, "fp8": torch.float8_e4m3fn}[kv]
    layer = runner.model.attention_layers()[0]
    assert layer.k_scale is not None and layer.k_scale.shape == layer.k_cache.shape[:3]
    lp, tokens, _ = _prompt_logprobs(llm)
    assert layer.k_scale.abs().sum() > 0
    # Exactly the numerics of a cache that quantizes each token at the store...
    sim_lp, sim_tokens, _ = _simulated(folder, kv)
    torch.testing.assert_close(lp, sim_lp, atol=1e-5, rtol=0)
    assert tokens == sim_tokens
    # ...which moves the log-probs a little (random tiny model, head_dim 8).
    err = (lp - baseline[0]).abs().max().item()
    assert 0 < err < tol


def test_triton_backend_reads_int8_cache(tiny_folder, baseline):
    """Whole-step equality with the reference is tests/kernels/test_triton_backend.py;
    here the engine runs the kernels end to end on an int8 pool."""
    folder, _ = tiny_folder("llama")
    llm = make_llm(folder, kv_cache_dtype="int8", attention_backend="triton", max_model_len=64)
    lp, tokens, gen = _prompt_logprobs(llm, 3)
    assert llm.engine.runner.kv_cache.dtype == torch.int8
    # A whole prompt attends to its fresh keys in the prefill kernel: the 16-bit numerics.
    torch.testing.assert_close(lp, baseline[0], atol=1e-4, rtol=0)
    # The first token comes from the prompt's step; later ones from decode steps over
    # the int8 codes: close to the 16-bit cache's log-probs, not equal.
    assert tokens[0][0] == baseline[1][0][0] and tokens[1][0] == baseline[1][1][0]
    same = tokens[0] == baseline[1][0][:3]
    if same:   # (a near-tie may flip a later token on another CPU)
        err = (gen[1:3] - baseline[2][1:3]).abs().max().item()
        assert 0 < err < 0.1
    assert torch.isfinite(gen).all()


@pytest.mark.parametrize("kv", ["int8", "fp8", "fp8_e4m3"])
def test_pool_capacity_grows(tiny_folder, kv):
    folder, _ = tiny_folder("llama")
    mem = 1 << 20
    plain = make_llm(folder, num_kv_blocks=None, kv_cache_memory=mem, dtype="bfloat16")
    quant = make_llm(folder, num_kv_blocks=None, kv_cache_memory=mem, dtype="bfloat16",
                     kv_cache_dtype=kv)
    p, q = plain.engine.runner.plan, quant.engine.runner.plan
    mc = quant.engine.config.model_config
    per_head = mc.head_dim + 4   # 1-byte codes + an fp32 scale
    assert q.kv_bytes_per_token == 2 * mc.num_hidden_layers * mc.num_key_value_heads * per_head
    assert q.num_blocks == mem // (q.kv_bytes_per_token * q.block_size)
    assert q.num_blocks > 1.5 * p.num_blocks
    assert "KV cache fp8" in q.describe() or "KV cache int8" in q.describe()


def test_bad_kv_cache_dtype_named():
    from slipstream.config import ModelConfig
    mc = ModelConfig("LlamaForCausalLM", 64, 32, 64, 2, 4, 2, 8, 128)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineArgs(kv_cache_dtype="int4", device="cpu").create_config("x", mc)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineArgs(kv_cache_dtype="kivi4", device="cpu",
                   speculative_method="ngram").create_config("x", mc)
    EngineArgs(kv_cache_dtype="int8", device="cpu", speculative_method="ngram").create_config("x", mc)
    cfg = EngineArgs(kv_cache_dtype="fp8_e4m3", device="cpu").create_config("x", mc)
    assert cfg.cache.kv_cache_dtype == "fp8"


def test_cli_flag_reaches_the_engine(tiny_folder, tmp_path, capsys):
    import json

    from slipstream.cli import main
    folder, _ = tiny_folder("llama")
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 4)
    ppl = {}
    for kv in ("auto", "int8"):
        assert main(["eval", "ppl", str(folder), "--text", str(text), "--context", "32",
                     "--dtype", "float32", "--device", "cpu", "--json", "--kv-cache-dtype", kv]) == 0
        ppl[kv] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["ppl"]
    assert ppl["int8"] != ppl["auto"] and abs(ppl["int8"] / ppl["auto"] - 1) < 0.05
    with pytest.raises(SystemExit):
        main(["generate", "--kv-cache-dtype", "int4", "hi"])

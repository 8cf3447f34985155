"""`slipstream quantize` end to end on a tiny random Llama: quantize layer by layer, save
safetensors + quantization_config, load back with LLM, and score like the model that
was quantized in memory."""
import json

import pytest
import torch

from slipstream.loader import open_model
from slipstream.quant.calibration import CalibrationModel
from slipstream.quant.checkpoint import save_quantized
from slipstream.quant.quantizer import QuantizeOptions, quantize_model
from tests.quant.conftest import make_llm, prompt_logprobs, random_prompts

CALIB = " ".join(["the quick brown fox jumps over the lazy dog", "1 2 3 4 5 6 7 8 9 10",
                  "in a hole in the ground there lived a hobbit"] * 12)


def in_memory_logprobs(cm: CalibrationModel, prompts) -> torch.Tensor:
    windows = [p["prompt_token_ids"] for p in prompts]
    states = cm.embed(windows)
    for i in range(len(cm.layers)):
        states = cm.run_layer(i, states)
    rows = []
    for logits, w in zip(cm.logits(states), windows):
        lp = torch.log_softmax(logits.float(), -1)[:-1]
        rows.append(lp.gather(1, torch.tensor(w[1:])[:, None])[:, 0])
    return torch.stack(rows)


@pytest.fixture(scope="module")
def dense(tiny_llama):
    return prompt_logprobs(make_llm(tiny_llama), random_prompts())


@pytest.mark.parametrize("opts,tol", [
    (dict(method="gptq", bits=4, act_order=False, true_sequential=False, clip_grid=0), 0.8),
    (dict(method="gptq", bits=4, sym=True), 0.8),      # act-order, true-sequential, clipping
    (dict(method="gptq", bits=4, static_groups=True), 0.8),
    (dict(method="gptq", bits=4, asym_calib=1.0, clip_separate=True, clip_grid=4), 0.8),
    (dict(method="awq", bits=4), 0.8),
    (dict(method="awq", bits=4, awq_duo=True, awq_clip_grid=4, awq_all_rows=True), 0.8),
    (dict(method="smoothquant"), 0.15),
    (dict(method="mixed", avg_bits=5.0, mixed_bits=(4, 8)), 0.8),
])
def test_quantize_save_load_round_trip(tiny_llama, dense, tmp_path, opts, tol, monkeypatch):
    # exact products on the CPU (the GGUF-block ones round activations to int8)
    monkeypatch.setenv("SLIPSTREAM_CPU_BLOCKS", "0")
    files = open_model(str(tiny_llama))
    q = QuantizeOptions(seq_len=32, num_windows=3, **opts)
    cm, report = quantize_model(files, q, CALIB)
    out = save_quantized(cm.model, files, tmp_path / "q", report.layers, q.method)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "slipstream"
    assert not list(out.glob("*.bin")) and (out / "model.safetensors").is_file()
    llm = make_llm(out)
    loaded = prompt_logprobs(llm, random_prompts())
    # The saved checkpoint computes what the in-memory quantized model computes ...
    torch.testing.assert_close(loaded, in_memory_logprobs(cm, random_prompts()),
                               atol=2e-4, rtol=0)
    # ... which stays close to the dense model (same tolerances as the load-time schemes).
    assert (loaded - dense).abs().mean() < tol
    perms = [m for m in llm.engine.runner.model.modules() if hasattr(m, "perm")]
    if q.method == "gptq":   # act-order stores a permutation unless its groups are static
        assert bool(perms) == (q.act_order and not q.static_groups)
    if q.method == "mixed":
        alloc = report.info["allocation"]
        assert alloc["avg_bits_exact"] <= 5.0 and alloc["objective_exact"] <= \
            alloc["objective_greedy"] + 1e-9
        assert set(alloc["bits"].values()) <= {4, 8}


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory):
    from tests.engine.conftest import build_hf_model
    from tests.loader.checkpoints import write_hf_tokenizer
    folder = tmp_path_factory.mktemp("quant-qwen2")
    build_hf_model("qwen2").save_pretrained(folder)     # q/k/v biases: v's bias is rescaled
    write_hf_tokenizer(folder)
    return folder


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen2"])   # both GQA (4 heads, 2 kv)
@pytest.mark.parametrize("how", ["smooth-0.5", "smooth-search", "awq"])
def test_folding_keeps_the_float_model(model, how, request):
    """Scales folded into the norms and into the v and up rows (all four sites of a layer,
    with GQA one scale per value channel), before any rounding, change nothing."""
    from slipstream.quant.calibration import InputStats, token_windows
    from slipstream.quant.quantizer import QuantizeOptions, _awq_fold, _smooth
    files = open_model(str(request.getfixturevalue(model)))
    cm = CalibrationModel(files)
    prompts = random_prompts()
    before = in_memory_logprobs(cm, prompts)
    windows = token_windows(files.tokenizer(), CALIB, 32, 4)
    states = cm.embed(windows)
    info = {}
    for i in range(len(cm.layers)):
        stats = {n: InputStats(m.input_size, hessian=how == "awq")   # AWQ: all-row Gram
                 for n, m in cm.linear_layers(i).items()}
        cm.run_layer(i, states, stats)
        if how == "awq":
            _awq_fold(cm, i, stats, QuantizeOptions(method="awq", group_size=32), info)
        else:
            _smooth(cm, i, stats, 0.5 if how == "smooth-0.5" else None, info)
        states = cm.run_layer(i, states)
    norm = cm.layers[0].input_layernorm.weight
    assert not torch.allclose(norm, torch.ones_like(norm)) or how == "awq"
    alphas = info["awq_alpha" if how == "awq" else "smoothquant_alpha"]
    assert len(alphas) == 4 * len(cm.layers)     # qkv, o, gate_up, down of every layer
    if how != "awq":   # the v and up rows were rescaled too
        up = cm.layers[0].mlp.gate_up_proj
        assert not torch.allclose(up.weight[up.output_sizes[0]:].abs().amax(1),
                                  dense_up_rows(files)[0].abs().amax(1))
    torch.testing.assert_close(in_memory_logprobs(cm, prompts), before, atol=1e-4, rtol=0)


def dense_up_rows(files):
    cm = CalibrationModel(files)
    up = cm.layers[0].mlp.gate_up_proj
    return up.weight[up.output_sizes[0]:], up


def test_cli_quantize_rtn_and_load(tiny_llama, dense, tmp_path, capsys):
    from slipstream.cli import main
    calib = tmp_path / "calib.txt"
    calib.write_text(CALIB)
    out = tmp_path / "rtn"
    assert main(["quantize", str(tiny_llama), "-o", str(out), "--method", "rtn",
                 "--calib", str(calib)]) == 0
    # The layer bar starts once the model is loaded and advances a layer at a time.
    err = capsys.readouterr().err
    n = open_model(str(tiny_llama)).config.num_hidden_layers
    assert err.index("loading") < err.index("rtn layers:"), err
    assert [f"{i}/{n}" in err for i in range(n + 1)] == [True] * (n + 1), err
    loaded = prompt_logprobs(make_llm(out), random_prompts())
    load_time = prompt_logprobs(make_llm(tiny_llama, quantization="rtn-int4"), random_prompts())
    torch.testing.assert_close(loaded, load_time, atol=2e-4, rtol=0)
    with pytest.raises(ValueError, match="quantization"):
        make_llm(out, quantization="fp8")
    with pytest.raises(SystemExit) as e:     # refused while parsing, before any load
        main(["quantize", str(tiny_llama), "-o", str(out), "--method", "nope"])
    assert e.value.code == 2 and "argument --method: invalid choice" in capsys.readouterr().err


def test_cli_gptq_settings_reach_the_options(tiny_llama, tmp_path):
    from slipstream.cli import main
    from slipstream.quant.quantizer import QuantizeOptions
    calib = tmp_path / "calib.txt"
    calib.write_text(CALIB)
    out = tmp_path / "gptq"
    assert main(["quantize", str(tiny_llama), "-o", str(out), "--calib", str(calib),
                 "--seq-len", "32", "--num-windows", "2", "--asym-calib", "0.25",
                 "--no-static-groups", "--clip-grid", "2"]) == 0
    opts = json.loads((out / "config.json").read_text())["quantization_config"]["options"]
    assert opts["asym_calib"] == 0.25 and opts["static_groups"] is False
    assert opts["damp"] == QuantizeOptions().damp        # unset: the library's default
    with pytest.raises(ValueError, match="asym_calib"):
        QuantizeOptions(asym_calib=1.5)


@pytest.mark.parametrize("kwargs, match", [
    (dict(damp=-1.0), "damp: expected a fraction in"), (dict(damp=0.0), "damp"),
    (dict(num_windows=0), "num_windows: expected an integer of at least 1"),
    (dict(seq_len=1), "seq_len"), (dict(clip_grid=-1), "clip_grid"), (dict(group_size=0), "group_size"),
    (dict(method="mixed", avg_bits=2.5), "avg_bits: 2.5 is below"),
    (dict(method="mixed", mixed_bits=(3, 5)), "mixed_bits"),
])
def test_quantize_options_are_checked_up_front(kwargs, match):
    """The Python API refuses what the command line's parser refuses, before any
    calibration (a LinAlgError from damp < 0, a ZeroDivisionError from 0 windows)."""
    from slipstream.quant.quantizer import QuantizeOptions
    with pytest.raises(ValueError, match=match):
        QuantizeOptions(**kwargs)


def test_token_windows_need_one_window():
    from slipstream.quant.calibration import token_windows
    tok = type("Tok", (), {"encode": staticmethod(lambda text: list(range(100)))})()
    assert len(token_windows(tok, "x", 10, 3)) == 3
    with pytest.raises(ValueError, match="num_windows: expected at least 1, got 0"):
        token_windows(tok, "x", 10, 0)

"""`slipstream analyze`: through cli.main (as the main CLI calls it), once
through `python -m slipstream.analysis`, and mounted on an argparse parser."""
import argparse
import json
import subprocess
import sys

import pytest

from slipstream.analysis.cli import add_parser, main

pytest.importorskip("matplotlib")


def _json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_model_json_has_the_documented_keys(capsys):
    data = _json(capsys, ["llama-2-70b", "--gpu", "A100", "--batch", "1", "--context", "1",
                          "--json"])
    for key in ("params", "active_params", "flops_per_token", "weight_bytes",
                "kv_bytes_per_token", "critical_batch_size", "decode_tokens_per_s_bound", "ops"):
        assert key in data
    names = [op["name"] for op in data["ops"]]
    assert names[:3] == ["norm", "qkv_proj", "attn_score"] and "lm_head" in names
    for op in data["ops"]:
        assert set(op) >= {"name", "flops", "bytes", "intensity", "bound"}
        assert op["bound"] in ("memory", "compute")
    # 137.4 GB of weights at 2.039 TB/s: 67.4 ms per token, 14.8 tokens/s.
    assert data["decode_tokens_per_s_bound"] == pytest.approx(2.039e12 / 137.45e9, rel=2e-3)
    # 80 layers x (K, V) x 8 heads x 128 x 2 bytes.
    assert data["kv_bytes_per_token"] == 80 * 2 * 8 * 128 * 2


def test_precision_flags_change_bytes(capsys):
    base = _json(capsys, ["llama-3-8b", "--json"])
    quant = _json(capsys, ["llama-3-8b", "--weight-dtype", "int4", "--kv-dtype", "fp8", "--json"])
    assert quant["weight_dtype"] == "int4-g128" and quant["kv_dtype"] == "fp8"
    assert quant["kv_bytes_per_token"] == base["kv_bytes_per_token"] / 2
    # Block linears at 0.5 + 2/128 bytes; embedding, LM head and norms stay bf16:
    # the 2 x 128256 x 4096 vocabulary matrices keep 2.1 of the 5.7 GB.
    linear = 32 * (4096 * 6144 + 4096 * 4096 + 3 * 4096 * 14336)
    norms = 32 * 2 * 4096 + 4096
    assert quant["weight_bytes"] == linear * 0.515625 + 2 * (2 * 128256 * 4096 + norms)
    assert base["weight_bytes"] == 2 * (linear + 2 * 128256 * 4096 + norms)
    assert quant["decode_tokens_per_s_bound"] > 2.5 * base["decode_tokens_per_s_bound"]


def test_text_table(capsys):
    assert main(["deepseek-v3", "--gpu", "H200", "--num-gpus", "8", "--batch", "32"]) == 0
    out = capsys.readouterr().out
    assert "deepseek-v3 on 8xH200" in out and "attn_latent" in out and "experts_down_proj" in out


def test_specdec(capsys):
    data = _json(capsys, ["specdec", "--alpha", "0.8", "--gamma", "4", "--c", "0.1", "--json"])
    assert data["tau"] == pytest.approx(3.3616)
    assert data["speedup"] == pytest.approx(3.3616 / 1.4)
    assert data["best_gamma"] == 6
    data = _json(capsys, ["specdec", "--alpha", "0.8", "--gamma", "4", "--c", "0.05",
                          "--gpu", "H100", "--json"])
    assert data["breakeven_batch"] == pytest.approx(989.4 / 3.35 * (3.3616 - 0.2) / 5)


def test_measure_then_use_the_profile(tmp_path, capsys):
    out = tmp_path / "cpu.json"
    data = _json(capsys, ["measure", "--device", "cpu", "--copy-mib", "1", "--matmul-n", "64",
                          "--out", str(out), "--json"])
    assert out.is_file() and data["path"] == str(out) and data["memory_bandwidth"] > 0
    used = _json(capsys, ["llama-3-8b", "--gpu", str(out), "--json"])
    assert used["gpu"] == data["name"] and used["gpu_source"].startswith("measured")


@pytest.mark.parametrize("suffix, magic", [(".png", b"\x89PNG"), (".svg", b"<?xml")])
def test_plot(tmp_path, capsys, suffix, magic):
    path = tmp_path / f"roofline{suffix}"
    assert main(["qwen3-235b-a22b", "--batch", "16", "--plot", str(path)]) == 0
    assert path.read_bytes().startswith(magic)
    assert str(path) in capsys.readouterr().out


def test_tables_and_config_path(tmp_path, capsys):
    gpus = _json(capsys, ["gpus", "--json"])
    assert [g["gpu"] for g in gpus] == ["A100", "H100", "H200", "B200"]
    models = _json(capsys, ["models", "--json"])
    assert len(models) == 9
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(dict(model_type="llama", hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4, vocab_size=100,
                                   tie_word_embeddings=True)))
    data = _json(capsys, [str(cfg), "--json"])
    # 2 x (4 x 64^2 attention + 3 x 64 x 128 MLP + 2 x 64 norms) + 100 x 64 tied + 64
    assert data["params"] == 2 * (4 * 64 * 64 + 3 * 64 * 128 + 128) + 6400 + 64


def test_user_errors_exit_2(capsys):
    assert main(["no-such-model"]) == 2
    assert "unknown model" in capsys.readouterr().err
    assert main(["llama-3-8b", "--weight-dtype", "int3"]) == 2
    assert main([]) == 2


def test_mounted_on_the_main_parser(capsys):
    parser = argparse.ArgumentParser(prog="slipstream")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["analyze", "specdec", "--alpha", "0.9", "--gamma", "4",
                              "--c", "0.1", "--json"])
    assert args.func(args) == 0
    assert json.loads(capsys.readouterr().out)["tau"] == pytest.approx(4.0951)
    args = parser.parse_args(["analyze", "--help"])      # reaches the form dispatcher
    assert args.func(args) == 0
    assert "analyze specdec" in capsys.readouterr().out


def test_python_dash_m():
    proc = subprocess.run([sys.executable, "-m", "slipstream.analysis", "specdec", "--alpha",
                           "0.8", "--gamma", "4", "--c", "0.1"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "3.3616" in proc.stdout and "best gamma" in proc.stdout

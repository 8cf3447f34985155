"""`slipstream analyze MODEL` takes the precision a model file stores its weights in,
read off the tensor table: Q4_1 blocks are 5 bits a weight, a Q8_0 head 8.5, a bf16
folder 16; presets keep bf16; --weight-dtype overrides."""
import json

from slipstream.analysis.cli import main
from slipstream.loader import default_model_path


def _run(capsys, *argv):
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_gguf_file_is_analysed_at_its_block_formats(capsys):
    path = str(default_model_path())
    data = _run(capsys, path)
    stored = data["stored_weights"]
    assert stored["bits"] == 5.0 and stored["head_bits"] == 8.5 and "q4_1" in stored["source"]
    bf16 = _run(capsys, path, "--weight-dtype", "bf16")
    assert "stored_weights" not in bf16
    assert data["weight_bytes"] < 0.5 * bf16["weight_bytes"]


def test_a_bf16_folder_and_a_preset(capsys, tmp_path):
    from tests.engine.conftest import build_hf_model
    model = build_hf_model("llama").to(dtype=__import__("torch").bfloat16)
    model.save_pretrained(tmp_path)
    stored = _run(capsys, str(tmp_path))["stored_weights"]
    assert abs(stored["bits"] - 16.0) < 0.01 and "bf16" in stored["source"]
    assert "stored_weights" not in _run(capsys, "llama-3-8b")

"""benchmarks/attention/bench_fp8_quantize.py --smoke: the quantiser benchmark's plumbing
on the CPU interpreter, its fused variants checked against the PyTorch quantiser (V^T's
columns and scales equal, codes within the interpreter's e4m3 cast, test_fp8_quantize.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_fp8_quantize_bench_smoke(tmp_path):
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks/attention/bench_fp8_quantize.py"),
                          "--smoke", "--out", str(tmp_path)], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert res.returncode == 0, res.stderr[-2000:]
    row = json.loads((tmp_path / "fp8_quantize.json").read_text())["shapes"][0]
    assert set(row["ms"]) == {"torch", "fused_keys_order", "fused_key_perm"}
    for check in row["checks"].values():
        assert check["v_cols_equal"] and check["v_scale_equal"], row
    assert (tmp_path / "fp8_quantize.md").exists()

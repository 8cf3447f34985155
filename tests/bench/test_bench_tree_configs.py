"""benchmarks/spec/bench_tree_configs.py --smoke: the sweep's plumbing on the CPU
interpreter (each config's output checked against fp32 SDPA, the report and best.txt
written), so the script keeps up with decode_configs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_tree_config_sweep_smoke(tmp_path):
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks/spec/bench_tree_configs.py"),
                          "--smoke", "--out", str(tmp_path)], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert res.returncode == 0, res.stderr[-2000:]
    rows = json.loads((tmp_path / "tree_configs.json").read_text())["rows"]
    assert [r["config"] for r in rows] == ["rule", "M16_32x2x2", "M16_32x2x3"]
    assert all(r["err"] < 1e-2 and "error" not in r for r in rows)
    assert (tmp_path / "tree_configs.md").exists() and (tmp_path / "best.txt").exists()

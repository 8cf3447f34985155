"""The decode launch configs rest on what Triton's pipeliner does with them on
Hopper; compile them for sm_90 (no GPU needed) and check it still does."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

from slipstream.kernels.decode_attention import (
    DEEP_CONFIG, QUANT_DEEP_CONFIG, QUANT_WIDE_CONFIG, TALL_CONFIG, WIDE_CONFIG)

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "benchmarks" / "attention" / "compile_report.py"
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
pytestmark = pytest.mark.skipif(not PTXAS.exists(), reason="Triton's wheel ships no ptxas here")


def _report(*args, config):
    """Run the tool in a process of its own: this one's kernels may be interpreted."""
    cmd = [sys.executable, str(TOOL), "decode", *args, "--json", "--block-n", str(config["BLOCK_N"]),
           "--warps", str(config["num_warps"]), "--stages", str(config["num_stages"])]
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_decode_configs_keep_the_tiles_in_flight_they_claim():
    deep, wide = _report(config=DEEP_CONFIG), _report(config=WIDE_CONFIG)
    assert deep["kv_buffers"] == [2] and wide["kv_buffers"] == [1]
    assert deep["programs_per_sm"] >= 2 and wide["programs_per_sm"] >= 4
    assert deep["stack_bytes"] == 0 and wide["stack_bytes"] == 0


def test_tall_tree_tiles_run_on_wgmma_without_spills():
    tall = _report("--block-m", "64", "--tree", config=TALL_CONFIG)
    assert tall["wgmma"] > 0 and tall["mma_sync"] == 0 and tall["stack_bytes"] == 0


def test_one_byte_kv_configs_keep_two_tiles_in_flight():
    """int8 / fp8 caches: the deep config streams two 128-key tiles (the bytes of
    two 64-key bf16 tiles) without spills, two programs an SM."""
    for kv in ("int8", "fp8"):
        deep = _report("--kv", kv, config=QUANT_DEEP_CONFIG)
        assert deep["kv_buffers"] == [2] and deep["stack_bytes"] == 0 and deep["programs_per_sm"] >= 2
    wide = _report("--kv", "int8", config=QUANT_WIDE_CONFIG)
    assert wide["kv_buffers"] == [2] and wide["programs_per_sm"] >= 4

"""The W8A8 and weight-only kernels compile for an H100/H200 (sm_90) on a machine without a GPU: Triton's
compiler runs ahead of time for a named target (its bundled LLVM and ptxas), in a child
process without the interpreter (sm90_compile.py). This covers what the CPU interpreter
cannot run: float8 operands, bf16 activations, TMA descriptors (a float8 GEMM once failed
to compile on the GPU alone: an integer `other=` of a masked float8 load); the PTX must
hold the Hopper tensor-core (wgmma) and TMA instructions."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def results():
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    run = subprocess.run([sys.executable, str(Path(__file__).with_name("sm90_compile.py"))],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("check", [f"{c}-{k}" for c in ("gemm", "tma_gemm", "producers")
                                   for k in ("int8", "fp8")]
                         + ["weight_only-int4", "weight_only-int8"]
                         + [f"decode_step-{k}" for k in ("bf16", "int8", "fp8")]
                         + ["w4_mma-bf16", "w4_mma-fp16", "kv_move-16bit", "kv_move-8bit"])
def test_compiles_for_sm90(results, check):
    if results[check].startswith("skip"):
        pytest.skip(results[check])
    assert results[check] == "ok", results[check]

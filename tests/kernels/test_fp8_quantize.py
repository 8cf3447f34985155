"""The fused FP8 input quantiser (fp8_quantize.py) against the PyTorch version
(gluon_fp8_inputs.quantize_fp8_inputs), in Triton's interpreter on the CPU.

The interpreter's float -> e4m3 cast has a bug of its own: a value that rounds up
into the next binade comes out at half (31.4 -> 16, where PyTorch and the GPU's
cvt.rn.satfinite give 32; about 1 value in 40 here). Codes are compared allowing
exactly that, and at most 5% of them; scales and layout exactly."""
import pytest
import torch

from slipstream.kernels.fp8_quantize import quantize_fp8_inputs_fused
from slipstream.kernels.gluon_fp8_inputs import dequantize_fp8_inputs, quantize_fp8_inputs


def _close_codes(a, b):
    tiny = 1e-3 * b.abs().max()  # e4m3's subnormals, about 2^-9 of a block's scale
    near = (a - b).abs() <= 0.07 * b.abs() + tiny
    halved = (a - b / 2).abs() <= 0.07 * b.abs() + tiny  # the interpreter's cast (see above)
    return bool((near | halved).all()) and (~near).float().mean().item() < 0.05


@pytest.mark.parametrize("rotate, q_block, key_perm", [(True, 64, False), (False, 128, False),
                                                       (True, 64, True)])
def test_fused_matches_pytorch(rotate, q_block, key_perm):
    g = torch.Generator().manual_seed(0)
    lengths = [1, 130, 300]
    cu = torch.tensor([0, 1, 131, 431], dtype=torch.int32)
    q = torch.randn(431, 4, 64, generator=g)
    k, v = (torch.randn(431, 2, 64, generator=g) * 3 for _ in range(2))
    a = quantize_fp8_inputs_fused(q, k, v, cu, max(lengths), rotate=rotate, q_block=q_block,
                                  key_perm=key_perm)
    b = quantize_fp8_inputs(q, k, v, cu, rotate=rotate, q_block=q_block, key_perm=key_perm)
    assert a.key_perm == b.key_perm == key_perm and torch.equal(a.v_cols, b.v_cols)
    assert a.v.shape == b.v.shape == (128, (431 + 3 * 16 + 15) // 16 * 16) and a.kv_block == 128
    assert a.v_starts.tolist() == b.v_starts.tolist() == [0, 16, 160, 464]
    unused = torch.ones(a.v.shape[1], dtype=torch.bool)
    unused[a.v_cols] = False
    assert not a.v.view(torch.uint8)[:, unused].any()
    for name in ("q_scale", "k_scale", "v_scale"):
        torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=1e-5, atol=0)
    for x, y in zip(dequantize_fp8_inputs(a), dequantize_fp8_inputs(b)):
        assert _close_codes(x, y)


def test_rejects_bad_input():
    cu = torch.tensor([0, 8], dtype=torch.int32)
    q, k = torch.zeros(8, 4, 64), torch.zeros(8, 2, 64)
    with pytest.raises(ValueError, match="q_block"):
        quantize_fp8_inputs_fused(q, k, k, cu, 8, q_block=48)
    with pytest.raises(ValueError, match="D contiguous"):
        quantize_fp8_inputs_fused(q, k, k.transpose(1, 2).contiguous().transpose(1, 2), cu, 8)


_CHILD = """
import json, torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import mangle_type
from slipstream.kernels.fp8_quantize import _quantize_blocks_kernel as K
t = dict(X=torch.empty(8, dtype=torch.bfloat16), R=torch.empty(8),
         Q=torch.empty(8, dtype=torch.float8_e4m3fn), Scale=torch.empty(8),
         CuSeqlens=torch.empty(2, dtype=torch.int32), VStarts=torch.empty(2, dtype=torch.int32), heads=16, stride_xt=2048, stride_xh=128,
         stride_q=2048)
out = []
for rot, tr, sub in ((True, False, 64), (False, True, 128)):
    c = dict(D=128, BLOCK=128, SUB=sub, ROTATE=rot, TRANSPOSE=tr, KEY_PERM=tr)
    sig = {n: "constexpr" if n in c else mangle_type(t[n]) for n in K.arg_names}
    # what a launch specialises: pointers and strides divisible by 16
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(K.arg_names)
             if n in ("X", "R", "Q", "Scale", "CuSeqlens", "VStarts", "stride_xt", "stride_xh", "stride_q")}
    ptx = triton.compile(ASTSource(K, sig, c, attrs), target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": 8}).asm["ptx"]
    out.append({"rotate": rot, "transpose": tr, "mma": "mma" in ptx,
                "cvt_e4m3": ptx.count("cvt.rn.satfinite.e4m3x2"),
                "byte_stores": ptx.count("st.global.b8"), "vector_stores": ptx.count("st.global.v4")})
print(json.dumps(out))
"""


def test_compiles_for_sm90():
    """The rotation on the tensor cores, the cast with the hardware's rounding, 16-byte stores."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=os.pathsep.join(
        [str(root)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    run = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    for r in json.loads(run.stdout.strip().splitlines()[-1]):
        assert r["mma"] == r["rotate"] and r["cvt_e4m3"] > 0, r
        # codes stored 16 bytes at a time, V^T's too (its request starts 16-aligned)
        assert r["vector_stores"] > 0 and r["byte_stores"] == 0, r

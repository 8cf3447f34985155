"""Fused elementwise kernels (RMSNorm + residual, SiLU * up, in-place rotary)
against their twins in `kernels.reference`, on random inputs.

Tolerances: fp32 1e-5 (only the order of fp32 operations differs); fp16 one
unit in the last place at the output's size (atol 2e-3, rtol 2e-3): both
round at the same points, but an fp32 reduction or fma in a different order
can flip a last bit of the fp16 result; bf16 (GPU only) two units (1.6e-2).
"""
import pytest
import torch

from slipstream.kernels import reference
from slipstream.kernels.rms_norm import rms_norm
from slipstream.kernels.rotary import rotary_inplace
from slipstream.kernels.silu_mul import silu_and_mul

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# bf16: two units in the last place (2^-7 relative); the interpreter cannot run bf16.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=2e-2, rtol=1.6e-2)}
DTYPES = [torch.float32, torch.float16,
          pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
              DEVICE == "cpu", reason="bf16 arithmetic needs a GPU (interpreter limit)"))]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,hidden", [(1, 64), (7, 96), (33, 200)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype, num_tokens, hidden, with_residual):
    x = (torch.randn(num_tokens, hidden, device=DEVICE) * 3).to(dtype)
    w = (torch.rand(hidden, device=DEVICE) + 0.5).to(dtype)
    res = torch.randn(num_tokens, hidden, device=DEVICE).to(dtype) if with_residual else None
    x_before = x.clone()
    got = rms_norm(x, w, 1e-5, res)
    want = reference.rms_norm(x, w, 1e-5, res)
    if with_residual:
        torch.testing.assert_close(got[1], want[1], atol=0, rtol=0)  # the add is exact
        got, want = got[0], want[0]
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert torch.equal(x, x_before), "inputs must not be modified"


def test_rms_norm_strided_rows():
    """Rows of a wider buffer (a view) are read with their own stride."""
    buf = torch.randn(5, 160, device=DEVICE)
    x, res = buf[:, :64], buf[:, 80:144]
    w = torch.rand(64, device=DEVICE) + 0.5
    out, new_res = rms_norm(x, w, 1e-6, res)
    want, want_res = reference.rms_norm(x, w, 1e-6, res)
    torch.testing.assert_close(out, want, **TOL[torch.float32])
    torch.testing.assert_close(new_res, want_res, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,d", [(1, 48), (9, 96), (4, 1500)])
def test_silu_and_mul(dtype, num_tokens, d):
    x = (torch.randn(num_tokens, 2 * d, device=DEVICE) * 2).to(dtype)
    torch.testing.assert_close(silu_and_mul(x), reference.silu_and_mul(x), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,heads,kv_heads,head_dim", [
    (1, 4, 4, 16), (6, 8, 2, 32), (5, 20, 4, 80), (3, 3, 1, 64)])
def test_rotary_inplace_on_qkv_view(dtype, num_tokens, heads, kv_heads, head_dim):
    from slipstream.layers.rotary import RotaryEmbedding
    torch.set_default_dtype(dtype)
    try:
        rope = RotaryEmbedding(head_dim, 128, 10000.0).to(DEVICE)
    finally:
        torch.set_default_dtype(torch.float32)
    qkv = torch.randn(num_tokens, heads + 2 * kv_heads, head_dim, device=DEVICE).to(dtype)
    positions = torch.randint(0, 128, (num_tokens,), device=DEVICE)
    want = qkv.clone()
    reference.rotary_inplace(want[:, :heads + kv_heads], positions, rope.cos, rope.sin)
    v_before = qkv[:, heads + kv_heads:].clone()
    out = rotary_inplace(qkv[:, :heads + kv_heads], positions, rope.cos, rope.sin)
    assert out.data_ptr() == qkv.data_ptr()
    torch.testing.assert_close(qkv, want, **TOL[dtype])
    assert torch.equal(qkv[:, heads + kv_heads:], v_before), "v heads must stay untouched"


def test_rotary_twin_matches_apply_rotary():
    """The in-place twin computes exactly what the model's torch path computes."""
    from slipstream.layers.rotary import RotaryEmbedding, apply_rotary
    rope = RotaryEmbedding(32, 64, 10000.0)
    qk = torch.randn(7, 6, 32)
    positions = torch.randint(0, 64, (7,))
    cos, sin = rope.lookup(positions)
    want = apply_rotary(qk, cos, sin)
    torch.testing.assert_close(reference.rotary_inplace(qk.clone(), positions, rope.cos, rope.sin),
                               want, atol=0, rtol=0)

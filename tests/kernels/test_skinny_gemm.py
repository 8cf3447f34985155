"""The skinny matmul of small-batch decode (kernels/skinny_gemm.py) against its
twin `reference.linear` (fp32 sum, one rounding), both inner products, with
ragged N and K (masked edges), a bias, and fewer rows than the tile.

Tolerances: fp32 1e-5 relative (order of fp32 sums; tl.dot in the interpreter
is exact fp32); fp16: the sum order may flip the last bit of the fp16 result
(atol/rtol 2e-3 at these magnitudes).
"""
import pytest
import torch
from torch import nn

from slipstream.kernels import reference
from slipstream.kernels.skinny_gemm import SkinnyConfig, row_class, skinny_linear
from slipstream.layers.linear import ColumnParallelLinear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}
CONFIGS = [SkinnyConfig(1, 8, 32, 4, 1), SkinnyConfig(1, 16, 64, 4, 1), SkinnyConfig(16, 16, 32, 4, 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("rows,n,k", [(1, 40, 96), (1, 33, 70), (5, 48, 64), (16, 17, 100)])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear_matches_twin(dtype, config, rows, n, k, bias):
    if rows > config.block_m and not (config.block_m == 1 and rows == 1):
        pytest.skip("the config holds fewer rows")
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=g).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=g).to(DEVICE, dtype) if bias else None
    got = skinny_linear(x, w, b, config)
    assert got.shape == (rows, n) and got.dtype == dtype
    torch.testing.assert_close(got, reference.linear(x, w, b), **TOL[dtype])


def test_row_class():
    assert row_class(1) == 1
    assert [row_class(m) for m in (2, 9, 16)] == [16, 16, 16]
    assert row_class(17) is None


def test_linear_layer_uses_the_tuned_choice():
    """A layer with `skinny` set runs the kernel for its row class and F.linear
    for the others (the choice None, or more rows than any class)."""
    torch.manual_seed(0)
    with torch.device(DEVICE):
        layer = ColumnParallelLinear(64, 48, bias=True)
    nn.init.normal_(layer.weight)
    nn.init.normal_(layer.bias)
    calls = []
    import slipstream.kernels.skinny_gemm as sg
    real = sg.skinny_linear

    def spy(x, w, b, cfg):
        calls.append((x.shape[0], cfg))
        return real(x, w, b, cfg)
    layer.skinny = {1: CONFIGS[0], 16: None}
    sg.skinny_linear, saved = spy, sg.skinny_linear
    try:
        for m in (1, 4, 40):
            x = torch.randn(m, 64, device=DEVICE)
            torch.testing.assert_close(layer(x), reference.linear(x, layer.weight, layer.bias),
                                       atol=1e-4, rtol=1e-5)
    finally:
        sg.skinny_linear = saved
    assert calls == [(1, CONFIGS[0])]

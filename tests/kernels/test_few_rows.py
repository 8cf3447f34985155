"""Few-row products of the roles named in layers/few_rows.ROLES go through the skinny
GEMM (Triton's interpreter on a CPU), the rest through F.linear."""
import pytest
import torch
import torch.nn.functional as F

from slipstream.kernels import skinny_gemm as skinny_module
from slipstream.layers import few_rows
from slipstream.layers.linear import ColumnParallelLinear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def calls(monkeypatch):
    seen = []
    real = skinny_module.skinny_gemm

    def spy(x, w, out=None, config=None):
        seen.append((x.shape[0], config))
        return real(x, w, out=out, config=config)

    monkeypatch.setattr(skinny_module, "skinny_gemm", spy)
    monkeypatch.setattr(few_rows, "ROLES", frozenset({"qkv", "o"}))
    return seen


def _layer(role, bias=False):
    torch.set_default_dtype(torch.bfloat16)
    try:
        layer = ColumnParallelLinear(64, 48, bias=bias).to(DEVICE)
    finally:
        torch.set_default_dtype(torch.float32)
    torch.nn.init.normal_(layer.weight, std=0.1)
    if bias:
        torch.nn.init.normal_(layer.bias)
    layer.gemv_role = role
    return layer


def test_named_roles_take_the_skinny_gemm_at_2_to_32_rows(calls):
    layer = _layer("qkv")
    for rows in (2, 7, 32):
        x = torch.randn(rows, 64, device=DEVICE).bfloat16()
        got = layer(x)
        torch.testing.assert_close(got.float(), F.linear(x.float(), layer.weight.float()),
                                   atol=3e-2, rtol=1e-2)
    assert [r for r, _ in calls] == [2, 7, 32]
    assert calls[0][1] == few_rows.CONFIGS["qkv"]


def test_other_rows_roles_and_layers_keep_f_linear(calls):
    x = torch.randn(33, 64, device=DEVICE).bfloat16()
    _layer("qkv")(x)                                   # over MAX_ROWS
    _layer("down")(x[:8])                              # a role not named
    _layer("o", bias=True)(x[:8])                      # a bias
    _layer(None)(x[:8])                                # no role
    torch.set_default_dtype(torch.float32)
    layer = ColumnParallelLinear(64, 48).to(DEVICE)  # fp32
    layer.gemv_role = "o"
    layer(x[:8].float())
    assert calls == []


def test_a_role_takes_it_from_its_fewest_rows(calls, monkeypatch):
    monkeypatch.setattr(few_rows, "ROLES", frozenset({"gate_up"}))
    layer = _layer("gate_up")
    x = torch.randn(few_rows.ROWS["gate_up"], 64, device=DEVICE).bfloat16()
    layer(x[:-1])
    layer(x)
    assert [r for r, _ in calls] == [few_rows.ROWS["gate_up"]]

"""The batch-1 TMA GEMV (kernels/tma_gemv.py, Gluon, sm_90 only).

On the CPU: each variant (plain, norm + residual add, SiLU * up, a walk over several
row blocks a program) compiles for sm_90 in a child process without the interpreter,
with its weight copied by TMA, the programmatic-dependent-launch wait and trigger,
and no register spills; the twin follows the norm and SiLU kernels' rounding; bad
input raises ValueError. On an H100/H200: outputs against the twin, odd shapes
included, the residual stream bit-equal, and a CUDA-graph replay of chained
launches equal to the eager run.
"""
import gc
import json
import weakref

import pytest
import torch
import torch.nn.functional as F

from slipstream.kernels import reference as kref
from slipstream.kernels.tma_gemv import check_inputs, descriptor, descriptors_of, reference, tma_gemv
from tests.kernels.conftest import assert_ring_compiled, compile_in_child

# name -> (N, K, NORM, ADD, ACT, config)
VARIANTS = {
    "plain": (4096, 4096, False, False, False, {}),
    "norm_add": (6144, 4096, True, True, False, {}),
    "silu_mul": (4096, 14336, False, False, True, {"BLOCK_N": 32, "num_warps": 8}),
    "odd_k_walk": (100, 576, True, False, False, {"BLOCK_K": 128, "STAGES": 6}),
}
_CHILD = """
import json, sys, torch
from slipstream.kernels import gluon_compile as gc
from slipstream.kernels import tma_gemv as T
out = {}
for name, (n, k, norm, add, act, cfg) in json.loads(sys.argv[1]).items():
    cfg = {**T.DEFAULT_CONFIG, **cfg}
    w = torch.empty(n, k, dtype=torch.bfloat16)
    x = torch.empty(1, 2 * k, dtype=torch.bfloat16)
    tiles = -(-k // cfg["BLOCK_K"])
    try:
        kern = gc._compile(T._gemv_kernel,
                           [T.descriptor(w, [cfg["BLOCK_N"], cfg["BLOCK_K"]]), x, x, x[0], x, x,
                            n, k, 1e-5],
                           dict(BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], STAGES=cfg["STAGES"],
                                NORM=norm, ADD=add, ACT=act, K_TILES=1 << (tiles - 1).bit_length(),
                                CHAIN=True, num_warps=cfg["num_warps"]))
        out[name] = gc.ring_report(kern)
    except FileNotFoundError as e:  # a Triton build without its ptxas / cuobjdump
        out[name] = {"skip": str(e)}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def compiled():
    return compile_in_child(_CHILD, json.dumps(VARIANTS))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_compiles_for_sm90(compiled, name):
    assert_ring_compiled(compiled[name])


def test_twin_rounds_as_the_norm_and_silu_kernels_twins():
    gen = torch.Generator().manual_seed(0)
    x, r = (torch.randn(1, 64, generator=gen).bfloat16() for _ in range(2))
    g = (1 + 0.1 * torch.randn(64, generator=gen)).bfloat16()
    w = torch.randn(8, 64, generator=gen).bfloat16()
    y, s = reference(x, w, norm_weight=g, eps=1e-5, residual=r)
    s_want = (x + r)                                          # HF adds in the model dtype
    assert torch.equal(s, s_want)
    assert torch.equal(y, F.linear(kref.rms_norm(s_want, g, 1e-5), w))
    gu = torch.randn(1, 128, generator=gen).bfloat16()
    y, _ = reference(gu, w, silu_mul=True)
    assert torch.equal(y, F.linear(kref.silu_and_mul(gu), w))


def test_descriptors_live_with_the_layer_that_owns_the_weight():
    layer = torch.nn.Linear(64, 32, bias=False, dtype=torch.bfloat16)
    cache = descriptors_of(layer)
    assert descriptors_of(layer) is cache
    d = descriptor(layer.weight, [16, 64], cache)
    assert descriptor(layer.weight, [16, 64], cache) is d          # made once
    assert descriptor(layer.weight, [32, 64], cache) is not d      # another box
    old = weakref.ref(layer.weight)
    del d
    layer.weight = torch.nn.Parameter(torch.zeros(32, 64, dtype=torch.bfloat16))
    assert descriptor(layer.weight, [16, 64], cache).base is layer.weight   # a new weight
    gc.collect()
    assert old() is None            # the cache does not keep the replaced weight alive
    now = weakref.ref(layer.weight)
    del layer, cache
    gc.collect()
    assert now() is None            # nor the weight of a layer that is gone
    assert descriptor(torch.zeros(16, 64, dtype=torch.bfloat16), [16, 64]).base.shape == (16, 64)


def test_rejects_bad_input():
    x, w = torch.zeros(1, 64, dtype=torch.bfloat16), torch.zeros(8, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="sm_90"):
        tma_gemv(x, w)   # CPU tensors
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9):
        return
    x, w = x.cuda(), w.cuda()
    for bad, match in (((x.repeat(2, 1), w), "one row"), ((x.float(), w), "dtype"),
                       ((x[:, :32], w), "wide"), ((x, w[:, :60].contiguous()), "aligned|wide")):
        with pytest.raises(ValueError, match=match):
            check_inputs(*bad)
    with pytest.raises(ValueError, match="2K wide"):
        check_inputs(x, w, silu_mul=True)
    with pytest.raises(ValueError, match="residual_out"):
        tma_gemv(x, w, norm_weight=x[0], residual=x, residual_out=x)


hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                            reason="the TMA GEMV needs an sm_90 GPU")


def _close(got, want, tol=1e-2):
    err = (got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6)
    assert err < tol, float(err)


@hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n, k", [(4096, 4096), (100, 576), (1537, 1000), (4096, 14336), (64, 64), (48, 40)])
@pytest.mark.parametrize("config", [{}, {"BLOCK_N": 32, "BLOCK_K": 128, "STAGES": 3, "PROGRAMS": 1}])
def test_matches_twin_on_gpu(dtype, n, k, config):
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    w = (torch.randn(n, k, device="cuda", generator=gen) * 0.05).to(dtype)
    x, r = (torch.randn(1, k, device="cuda", generator=gen).to(dtype) for _ in range(2))
    g = (1 + 0.1 * torch.randn(k, device="cuda", generator=gen)).to(dtype)
    _close(tma_gemv(x, w, config=config), F.linear(x.float(), w.float()))
    for add in (False, True):
        ro = torch.empty_like(x)
        y = tma_gemv(x, w, norm_weight=g, eps=1e-5, residual=r if add else None,
                     residual_out=ro if add else None, chain=True, config=config)
        want, s = reference(x, w, norm_weight=g, eps=1e-5, residual=r if add else None)
        _close(y, want)
        if add:
            assert torch.equal(ro, s)
    gu = torch.randn(1, 2 * k, device="cuda", generator=gen).to(dtype)
    _close(tma_gemv(gu, w, silu_mul=True, config=config), reference(gu, w, silu_mul=True)[0])


@hopper
def test_chained_launches_replay_in_a_graph():
    gen = torch.Generator(device="cuda").manual_seed(3)
    w1 = (torch.randn(6144, 4096, device="cuda", generator=gen) * 0.02).bfloat16()
    w2 = (torch.randn(4096, 3072, device="cuda", generator=gen) * 0.02).bfloat16()
    x, r = (torch.randn(1, 4096, device="cuda", generator=gen).bfloat16() for _ in range(2))
    g = torch.ones(4096, device="cuda").bfloat16()
    ro, y1, y2 = torch.empty_like(x), torch.empty(1, 6144, device="cuda").bfloat16(), torch.empty_like(x)

    def chain():
        tma_gemv(x, w1, norm_weight=g, eps=1e-5, residual=r, residual_out=ro, out=y1, chain=True)
        tma_gemv(y1, w2, silu_mul=True, out=y2, chain=True)
    chain()
    torch.cuda.synchronize()
    eager = y2.clone()
    y2.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y2, eager)
    _close(eager, reference(reference(x, w1, norm_weight=g, eps=1e-5, residual=r)[0], w2,
                            silu_mul=True)[0])

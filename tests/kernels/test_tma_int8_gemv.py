"""The batch-1 8-bit TMA GEMV (kernels/tma_int8_gemv.py, Gluon, sm_90 only): opt-in, one of
the launches the tuner of a w8a16 layer's one-row product weighs
(quant_gemm.tiled_int_weight_gemm, SLIPSTREAM_TMA_INT8_GEMV=1).

On the CPU: symmetric and asymmetric codes compile for sm_90 in a child process without
the interpreter, with the words copied by TMA, the programmatic-dependent-launch wait and
trigger, and no register spills; bad input raises ValueError. On an H100/H200: outputs
against the product of the dequantized weight, several launches and odd row counts; the
tuned product of an int8 layer with the TMA launch forced, against the GEMV's.
"""
import json

import pytest
import torch
import torch.nn.functional as F

from slipstream.kernels.tma_int8_gemv import check_inputs, tma_int8_gemv
from tests.kernels.conftest import assert_ring_compiled, compile_in_child

# name -> (N, K, SYM, config)
VARIANTS = {
    "sym": (4096, 4096, True, {}),
    "asym_walk": (1000, 14336, False, {"BLOCK_N": 32, "STAGES": 6, "PROGRAMS": 2}),
}
_CHILD = """
import json, sys, torch
from slipstream.kernels import gluon_compile as gc
from slipstream.kernels import tma_int8_gemv as T
from slipstream.kernels.tma_gemv import descriptor
out = {}
for name, (n, k, sym, cfg) in json.loads(sys.argv[1]).items():
    cfg = {**T.DEFAULT_CONFIG, **cfg}
    words = torch.empty(n, k // 4, dtype=torch.int32)
    x = torch.empty(1, k, dtype=torch.bfloat16)
    s = torch.empty(n)
    boxes = -(-k // (4 * T.BOX_WORDS))
    try:
        kern = gc._compile(T._int8_gemv_kernel,
                           [descriptor(words, [cfg["BLOCK_N"], T.BOX_WORDS]), x, s, s, x, n, k],
                           dict(BLOCK_N=cfg["BLOCK_N"], STAGES=cfg["STAGES"], SYM=sym,
                                X_ROWS=4 * (1 << (boxes - 1).bit_length()), CHAIN=True,
                                num_warps=cfg["num_warps"]))
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


def test_rejects_bad_input():
    x = torch.zeros(1, 256, dtype=torch.bfloat16)
    words, scales = torch.zeros(8, 64, dtype=torch.int32), torch.ones(8)
    with pytest.raises(ValueError, match="sm_90"):
        tma_int8_gemv(x, words, scales)   # CPU tensors
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9):
        return
    x, words, scales = x.cuda(), words.cuda(), scales.cuda()
    for bad, match in (((x.repeat(2, 1), words, scales, None), "one 16-bit row"),
                       ((x[:, :128], words, scales, None), "words"),
                       ((x, words.float(), scales, None), "words"),
                       ((x, words, scales[:4], None), "per-channel")):
        with pytest.raises(ValueError, match=match):
            check_inputs(*bad)


def test_takes_only_one_row_of_an_8bit_per_channel_layer_on_sm90(monkeypatch):
    from slipstream.kernels.quant_gemm import tma_int8_fits
    monkeypatch.setenv("SLIPSTREAM_TMA_INT8_GEMV", "1")
    words = torch.zeros(8, 64, dtype=torch.int32)
    x = torch.zeros(1, 256, dtype=torch.bfloat16)
    assert not tma_int8_fits(x, words, 8, 256, 128)          # not on a GPU
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9):
        return
    x, words = x.cuda(), words.cuda()
    assert tma_int8_fits(x, words, 8, 256, 128)
    monkeypatch.setenv("SLIPSTREAM_TMA_INT8_GEMV", "0")          # the default: off
    assert not tma_int8_fits(x, words, 8, 256, 128)
    monkeypatch.setenv("SLIPSTREAM_TMA_INT8_GEMV", "1")
    for args in ((x.repeat(2, 1), words, 8, 256, 128), (x.float(), words, 8, 256, 128),
                 (x, words, 4, 256, 128), (x, words, 8, 128, 128), (x, words, 8, 256, 64)):
        assert not tma_int8_fits(*args)


hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                            reason="the TMA GEMV needs an sm_90 GPU")


@hopper
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("n, k", [(4096, 4096), (1000, 14336), (48, 128), (100, 640)])
@pytest.mark.parametrize("config", [{}, {"BLOCK_N": 32, "STAGES": 6, "PROGRAMS": 2}])
def test_matches_the_dequantized_product_on_gpu(sym, n, k, config):
    from slipstream.kernels.int_weight_gemv import tile_codes
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    codes = torch.randint(0, 256, (n, k), device="cuda", generator=gen, dtype=torch.int32).to(torch.uint8)
    scales = torch.rand(n, 1, device="cuda", generator=gen) * 1e-3 + 1e-4
    zeros = None if sym else torch.randint(100, 156, (n, 1), device="cuda", generator=gen,
                                           dtype=torch.int32).to(torch.uint8)
    x = torch.randn(1, k, device="cuda", generator=gen).bfloat16()
    want = F.linear(x.float(), (codes.float() - (128.0 if sym else zeros.float())) * scales)
    cache, words = {}, tile_codes(codes, 8, 128)
    for _ in range(2):   # the second call takes the cached descriptor
        got = tma_int8_gemv(x, words, scales, zeros, config=config, chain=True, descriptors=cache)
        err = (got.float() - want).abs().max() / want.abs().max()
        assert err < 1e-2, float(err)
    assert len(cache) == 1


@hopper
@pytest.mark.parametrize("sym", [True, False])
def test_tuned_product_through_the_tma_launch_on_gpu(sym, monkeypatch):
    """tiled_int_weight_gemm at one row with only the TMA launches to choose from gives the
    GEMV's result, keeps its descriptors (one a box shape the tuner tried) in the layer's
    cache, and is what the tuner recorded for the bucket."""
    from slipstream.kernels import quant_gemm, quant_tuning
    from slipstream.kernels.int_weight_gemv import default_gemv_config, int_weight_gemv, tile_codes
    n, k = 1000, 4096
    gen = torch.Generator(device="cuda").manual_seed(7)
    codes = torch.randint(0, 256, (n, k), device="cuda", generator=gen, dtype=torch.int32).to(torch.uint8)
    scales = torch.rand(n, 1, device="cuda", generator=gen) * 1e-3 + 1e-4
    zeros = None if sym else torch.randint(100, 156, (n, 1), device="cuda", generator=gen,
                                           dtype=torch.int32).to(torch.uint8)
    words = tile_codes(codes, 8, 128)
    x = torch.randn(1, k, device="cuda", generator=gen).bfloat16()
    monkeypatch.setenv("SLIPSTREAM_TMA_INT8_GEMV", "1")
    monkeypatch.setattr(quant_tuning, "gemv_candidates", lambda *a: [])
    monkeypatch.setattr(quant_tuning, "_BEST", {})
    cache = {}
    got = quant_gemm.tiled_int_weight_gemm(x, words, scales, zeros, 8, k, 128, cache)
    want = int_weight_gemv(x, words, scales, zeros, 8, k, 128,
                           default_gemv_config(1, n, k, 128, x.device))
    assert (got.float() - want.float()).abs().max() / want.float().abs().max() < 1e-2
    n_shapes = len({c["BLOCK_N"] for c in quant_tuning.tma_int8_candidates()})
    assert 1 <= len(cache) <= n_shapes and all(d.base is words for d in cache.values())
    chosen = [c for key, c in quant_tuning.tuned_configs().items() if key[0] == "int_gemv"]
    assert chosen and all(c.get("TMA") for c in chosen)

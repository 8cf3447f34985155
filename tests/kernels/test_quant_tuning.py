"""The launch-configuration tuner of the quantized GEMMs (kernels/quant_tuning.py): it picks
the fastest candidate once per bucket, skips candidates that fail, never tunes during a
graph capture or off CUDA; every candidate configuration computes the right product."""
import pytest
import torch

from slipstream.kernels import quant_tuning, reference
from slipstream.kernels.quant_gemm import int_weight_gemm
from slipstream.kernels.quant_tuning import choose, int_weight_candidates, m_bucket
from slipstream.quant.primitives import pack_codes, quantize


def test_m_bucket():
    assert [m_bucket(m) for m in (1, 2, 3, 4, 5, 16, 17, 24, 2048, 2049, 10 ** 6)] == \
        [1, 2, 4, 4, 8, 16, 32, 32, 2048, 4096, 8192]


@pytest.fixture
def fake_gpu(monkeypatch):
    """Tuning switched on with a fake clock: a call's time is its config's BLOCK_N."""
    monkeypatch.setattr(quant_tuning, "tuning_enabled", lambda device: True)
    monkeypatch.setattr(quant_tuning, "_weight_copies", lambda w, device: [w, w])
    monkeypatch.setattr(quant_tuning, "_time_calls", lambda calls: min(c() for c in calls))
    monkeypatch.setattr(quant_tuning, "_BEST", {})
    return monkeypatch


def _calls(cfg, copies):
    def call():
        if cfg["BLOCK_N"] == 8:
            raise RuntimeError("out of shared memory")
        return cfg["BLOCK_N"]
    return [call for _ in copies]


def test_choose_takes_fastest_once_and_skips_failures(fake_gpu):
    cands = [dict(BLOCK_N=64), dict(BLOCK_N=8), dict(BLOCK_N=32), dict(BLOCK_N=128)]
    asked = []

    def candidates():
        asked.append(1)
        return cands
    dev = torch.device("cpu")
    default = dict(BLOCK_N=999)
    assert choose(("k",), 3, dev, default, candidates, (), _calls) == dict(BLOCK_N=32)
    assert choose(("k",), 4, dev, default, candidates, (), _calls) == dict(BLOCK_N=32)  # same bucket
    assert len(asked) == 1
    assert quant_tuning.tuned_configs() == {("k", 4): dict(BLOCK_N=32)}
    # Every candidate failing: the default, remembered.
    assert choose(("j",), 1, dev, default, lambda: [dict(BLOCK_N=8)], (), _calls) == default


def test_choose_never_tunes_while_capturing(fake_gpu):
    fake_gpu.setattr(quant_tuning, "_capturing", lambda device: True)
    default = dict(BLOCK_N=999)
    assert choose(("k",), 1, torch.device("cpu"), default,
                  lambda: pytest.fail("tuned during a capture"), (), _calls) == default
    assert quant_tuning.tuned_configs() == {}


def test_off_cuda_no_tuning():
    assert not quant_tuning.tuning_enabled(torch.device("cpu"))


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("m", [1, 40])
def test_every_int_weight_candidate_is_correct(m):
    n, k, group = 40, 256, 128
    w = torch.randn(n, k) * 0.1
    qt = quantize(w, 4, False, "group", group)
    qw, s, z = (pack_codes(qt.codes, 4).to(DEVICE), qt.scale.float().contiguous().to(DEVICE),
                qt.zero.to(torch.uint8).contiguous().to(DEVICE))
    x = torch.randn(m, k, dtype=torch.float16)
    ref = reference.int_weight_linear(x.float(), qw.cpu(), s.cpu(), z.cpu(), 4, group)
    cands = int_weight_candidates(m, n, k, 128, torch.device(DEVICE))
    assert len(cands) >= 6
    for cfg in cands:
        y = int_weight_gemm(x.to(DEVICE), qw, s, z, 4, group, cfg)
        torch.testing.assert_close(y.float().cpu(), ref, atol=2e-2, rtol=2e-2, msg=str(cfg))


def test_a_forced_gemv_config_is_the_only_candidate(monkeypatch):
    """SLIPSTREAM_GEMV_CONFIG pins the GEMV launch (for measurements); each shape keeps
    its own K split unless one is given; a malformed value names the variable."""
    import json

    import pytest
    import torch

    from slipstream.kernels import quant_tuning
    cpu = torch.device("cpu")
    monkeypatch.setenv("SLIPSTREAM_GEMV_CONFIG", json.dumps(dict(BLOCK_N=128, num_warps=4,
                                                                 num_stages=3)))
    (a,) = quant_tuning.gemv_candidates(6144, 4096, 128, cpu)
    (b,) = quant_tuning.gemv_candidates(4096, 14336, 128, cpu)
    assert (a["BLOCK_N"], a["num_stages"], a["PREFETCH"]) == (128, 3, False)
    assert a["SPLIT_K"] <= 4096 // 128 and b["SPLIT_K"] >= a["SPLIT_K"]
    monkeypatch.setenv("SLIPSTREAM_GEMV_CONFIG", json.dumps(dict(BLOCK_N=64, num_warps=2, SPLIT_K=2)))
    assert quant_tuning.gemv_candidates(6144, 4096, 128, cpu)[0]["SPLIT_K"] == 2
    monkeypatch.setenv("SLIPSTREAM_GEMV_CONFIG", "[1]")
    with pytest.raises(ValueError, match="SLIPSTREAM_GEMV_CONFIG"):
        quant_tuning.gemv_candidates(6144, 4096, 128, cpu)


@pytest.mark.parametrize("m", [1, 9, 16, 32, 33, 64, 128])
def test_w4_mma_candidates_by_rows(m):
    """The 4-bit tensor-core launches weighed at m rows (sm_90): the GEMV up to 64 rows,
    the warpgroup kernel from 9 with one warpgroup a tile up to 32 rows and two above,
    dequantize + cuBLAS from 16; K splits never above the groups."""
    default = dict(NT=1, SPLIT=8, DEPTH=1)
    cands = quant_tuning.w4_mma_candidates(default, 4096, m, wgmma=True)
    wg = [c for c in cands if c.get("WG")]
    gemv = [c for c in cands if not c.get("WG") and not c.get("DEQUANT")]
    assert bool(gemv) == (m <= 64) and bool(wg) == (m > 8)
    assert any(c.get("DEQUANT") for c in cands) == (m >= 16)
    assert {c["WGS"] for c in wg} <= ({1} if m <= 32 else {2})
    assert all(1 <= c["SPLIT"] <= 32 and c["NT"] in (1, 2) for c in wg + gemv)
    assert len({tuple(sorted(c.items())) for c in cands}) == len(cands)     # no repeats
    assert not [c for c in quant_tuning.w4_mma_candidates(default, 4096, m) if c.get("WG")]

import pytest
import torch

from slipstream.quant import primitives as P


def _w(rows=16, cols=256, seed=0):
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("gran", ["tensor", "channel", "group"])
def test_round_trip_error_is_bounded_by_half_a_step(bits, sym, gran):
    w = _w()
    qt = P.quantize(w, bits, sym, gran, group_size=64)
    assert qt.codes.dtype == torch.uint8 and int(qt.codes.max()) <= 2 ** bits - 1
    rows = {"tensor": 1, "channel": 16, "group": 16}[gran]
    groups = {"tensor": 1, "channel": 1, "group": 4}[gran]
    assert qt.scale.shape == (rows, groups)
    err = (qt.dequantize() - w).abs()
    step = P._expand(qt.scale, 16, 256, qt.group_cols)
    # Nothing is clipped with clip=1, so every error is at most half a step.
    assert (err <= step / 2 + 1e-5).all()
    # Re-quantizing the dequantized values with the same parameters gives the same codes.
    again = P.quantize_codes(qt.dequantize(), qt.scale, qt.zero, bits, qt.group_cols)
    assert torch.equal(again, qt.codes)


def test_finer_granularity_and_more_bits_lower_the_error():
    w = _w() * torch.logspace(-1, 1, 16)[:, None]     # rows of very different ranges
    e = {g: P.mse(w, P.fake_quantize(w, 4, True, g, 32)) for g in P.GRANULARITIES}
    assert e["group"] < e["channel"] < e["tensor"]
    errs = [P.mse(w, P.fake_quantize(w, b, False, "group", 32)) for b in (2, 3, 4, 8)]
    assert errs == sorted(errs, reverse=True)
    assert P.sqnr_db(w, P.fake_quantize(w, 8, True, "channel")) > 35


def test_symmetric_keeps_zero_exact_and_asymmetric_fits_a_shifted_range():
    w = _w().abs() + 1.0          # all positive: symmetric wastes half its codes
    assert P.mse(w, P.fake_quantize(w, 4, False, "channel")) < \
        P.mse(w, P.fake_quantize(w, 4, True, "channel"))
    z = torch.zeros(4, 8)
    z[0, 3] = 1.0
    assert P.fake_quantize(z, 4, True, "channel")[1].eq(0).all()


def test_error_breakdown_clipping_trades_range_for_step():
    w = torch.randn(8, 1024, generator=torch.Generator().manual_seed(1))
    full = P.error_breakdown(w, P.quantize(w, 3, True, "channel"))
    assert full["clipped_fraction"] == 0 and full["clip_mse"] == 0
    # Rounding error of a Gaussian at 3 bits is close to the uniform-noise model s^2 / 12.
    assert full["round_mse"] == pytest.approx(full["uniform_noise_mse"], rel=0.2)
    clipped = P.error_breakdown(w, P.quantize(w, 3, True, "channel", clip=0.6))
    assert clipped["clipped_fraction"] > 0 and clipped["clip_mse"] > 0
    assert clipped["round_mse"] < full["round_mse"]
    assert clipped["mse"] == pytest.approx(clipped["clip_mse"] + clipped["round_mse"], rel=1e-5)
    ratio = P.search_clip(w, 3, True, "channel")
    best = P.mse(w, P.fake_quantize(w, 3, True, "channel", clip=ratio))
    assert best < full["mse"] and (ratio < 1).all()


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_packing_round_trips(bits):
    codes = torch.randint(0, 2 ** bits, (5, 64), dtype=torch.uint8)
    packed = P.pack_codes(codes, bits)
    assert packed.shape == (5, P.packed_cols(64, bits))
    assert torch.equal(P.unpack_codes(packed, bits), codes)


def test_int4_packing_layout_low_nibble_first():
    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    assert P.pack_int4(codes).tolist() == [[0x21, 0x0F]]


def test_bad_options_raise_value_errors():
    with pytest.raises(ValueError, match="bits"):
        P.quantize(_w(), 5)
    with pytest.raises(ValueError, match="group_size"):
        P.quantize(_w(), 4, group_size=0)
    with pytest.raises(ValueError, match="granularity"):
        P.quantize(_w(), 4, granularity="row")


def test_dynamic_rows_int8_and_fp8():
    x = torch.randn(6, 128) * torch.logspace(-2, 2, 6)[:, None]
    q, s = P.quantize_int8_rows(x)
    assert q.dtype == torch.int8 and s.shape == (6, 1)
    assert ((q.float() * s - x).abs() <= s / 2 + 1e-6).all()
    f, fs = P.quantize_fp8_rows(x)
    assert f.dtype == torch.float8_e4m3fn
    rel = ((f.float() * fs - x).abs() / x.abs().clamp_min(1e-3 * x.abs().amax(-1, keepdim=True)))
    assert rel.median() < 0.04     # e4m3 keeps 3 mantissa bits: relative step 1/8


def test_a_narrower_last_group_is_quantized_on_its_own_range():
    w = _w(cols=96)                    # group 64: one full group and one of 32 columns
    w[:, 64:] *= 10.0
    qt = P.quantize(w, 4, False, "group", 64)
    assert qt.scale.shape == (16, 2)
    err = (qt.dequantize() - w).abs()
    assert (err <= P._expand(qt.scale, 16, 96, 64) / 2 + 1e-5).all()
    tail = P.quantize(w[:, 64:], 4, False, "channel")
    torch.testing.assert_close(qt.scale[:, 1:], tail.scale)

import pytest
import torch

from slipstream.analysis.hardware import (
    GPUS, HardwareProfile, get_hardware, load_profile, measure_copy_bandwidth,
    measure_matmul_rate, measure_profile, save_profile)


def test_critical_intensity_from_datasheets():
    # Chapter 1.2/1.4: A100 312 TFLOP/s over 2.0 TB/s -> 156; the 80GB SXM4 part
    # streams 2.039 TB/s, so 312 / 2.039 = 153.0. H100: 989.4 / 3.35 = 295.3.
    assert GPUS["A100"].critical_intensity() == pytest.approx(153.0, abs=0.1)
    assert GPUS["H100"].critical_intensity() == pytest.approx(295.3, abs=0.1)
    # B200 (HGX, 1000 W): 2250 TFLOP/s over 8 TB/s.
    assert GPUS["B200"].critical_intensity() == pytest.approx(281.25, rel=1e-9)


def test_peak_falls_back_to_bf16_without_fp8_units():
    assert GPUS["A100"].peak_flops("fp8") == GPUS["A100"].bf16_flops
    assert GPUS["H100"].peak_flops("fp8") == pytest.approx(2 * 989.4e12, rel=1e-3)
    with pytest.raises(ValueError):
        GPUS["H100"].peak_flops("fp4")


def test_lookup_is_case_insensitive_and_accepts_suffix():
    assert get_hardware("h100") is GPUS["H100"]
    assert get_hardware("H100-SXM") is GPUS["H100"]
    with pytest.raises(ValueError, match="unknown hardware"):
        get_hardware("no-such-gpu")


def test_measurements_on_cpu_are_positive_and_plausible():
    bw = measure_copy_bandwidth("cpu", nbytes=4 << 20, repeats=3)
    rate = measure_matmul_rate("cpu", torch.float32, n=128, repeats=3)
    # Any machine that runs the tests copies faster than 100 MB/s and
    # multiplies faster than 100 MFLOP/s; none exceeds 100 TB/s or 100 PFLOP/s.
    assert 1e8 < bw < 1e14
    assert 1e8 < rate < 1e17


def test_profile_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("SLIPSTREAM_HARDWARE_DIR", str(tmp_path))
    prof = measure_profile("cpu", copy_bytes=1 << 20, matmul_n=64)
    assert prof.source.startswith("measured")
    path = save_profile(prof)
    assert path.parent == tmp_path and path.suffix == ".json"
    assert load_profile(path) == prof
    # A stored profile is found again by its device name.
    assert get_hardware(prof.name) == prof


def test_explicit_profile_path(tmp_path):
    prof = HardwareProfile("toy", 1e11, 1e12, source="measured on toy")
    path = save_profile(prof, tmp_path / "x" / "toy.json")
    assert get_hardware(str(path)) == prof

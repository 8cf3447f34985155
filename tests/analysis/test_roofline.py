"""Roofline bounds against the chapter's worked examples (sections 1.2, 1.5, 1.6)."""
import pytest

from slipstream.analysis.flops import Precisions
from slipstream.analysis.hardware import GPUS, HardwareProfile
from slipstream.analysis.presets import PRESETS
from slipstream.analysis.roofline import (critical_batch_size, decode_bound, phase_table,
                                          weights_critical_batch)

# The chapter's round figures: A100 2.0 TB/s, 312 TFLOP/s; H100 3.35 TB/s, 990 TFLOP/s.
CHAPTER_A100 = HardwareProfile("A100 (chapter)", 2.0e12, 312e12)
CHAPTER_H100 = HardwareProfile("H100 (chapter)", 3.35e12, 990e12)
LLAMA2 = PRESETS["llama-2-70b"]
# 68.98B parameters less the 262M-entry embedding table, 2 bytes each: 137.4 GB.
LLAMA2_BYTES = 2 * (68_976_648_192 - 32000 * 8192)


@pytest.mark.parametrize("hw, chapter_ms, critical", [
    (CHAPTER_A100, 70.0, 156.0), (CHAPTER_H100, 42.0, 295.5)])
def test_llama2_70b_single_request_decode(hw, chapter_ms, critical):
    """Chapter 1.2: 140 GB at 2.0 TB/s is 70 ms (A100), at 3.35 TB/s 42 ms (H100).
    With the real 137.4 GB the bound is 68.7 ms and 41.0 ms."""
    step = decode_bound(LLAMA2, hw, batch=1, context=1)
    assert step.whole.bound == "memory"
    assert step.whole.time == pytest.approx(LLAMA2_BYTES / hw.memory_bandwidth, rel=1e-3)
    assert step.whole.time * 1e3 == pytest.approx(chapter_ms, rel=0.025)
    assert step.tokens_per_s == pytest.approx(1 / step.whole.time)
    # 137.4 GFLOPs at peak: 0.44 ms on A100 (chapter: 0.45 ms).
    assert step.whole.compute_time == pytest.approx(2 * LLAMA2_BYTES / 2 / hw.bf16_flops, rel=2e-3)
    # Intensity 1 FLOP/B against a critical 156 (A100) / 295.5 (H100).
    assert step.whole.op.intensity == pytest.approx(1.0, abs=0.01)
    assert hw.critical_intensity() == pytest.approx(critical, rel=1e-3)


def test_critical_batch_is_the_critical_intensity_for_bf16_weights():
    """Decode at batch B does 2B FLOPs per bf16 weight (2 bytes): intensity B.
    So the critical batch equals the critical intensity (156 on the chapter's
    A100), not half of it (the chapter's 78)."""
    assert weights_critical_batch(CHAPTER_A100, 2.0) == pytest.approx(156.0)
    assert weights_critical_batch(GPUS["H100"], 2.0) == pytest.approx(295.3, abs=0.1)
    assert weights_critical_batch(GPUS["H100"], 1.0, "fp8") == pytest.approx(295.4, abs=0.1)
    # W4A16 keeps bf16 math but reads ~a quarter of the bytes: 295.3 * 0.515625 / 2.
    assert weights_critical_batch(GPUS["H100"], 0.515625) == pytest.approx(76.1, abs=0.1)


def test_model_critical_batch_with_activations_and_kv():
    # Context 1: activation traffic (B x 2 x (d_in + d_out) bytes per GEMM) nudges
    # the threshold a few percent above 156.
    b = critical_batch_size(LLAMA2, CHAPTER_A100, context=1)
    assert 156 <= b <= 165
    step = decode_bound(LLAMA2, CHAPTER_A100, batch=b, context=1)
    below = decode_bound(LLAMA2, CHAPTER_A100, batch=b - 1, context=1)
    assert step.whole.op.intensity >= 156 > below.whole.op.intensity
    # Context 4096: each sequence reads 4096 x 327,680 B = 1.34 GB of KV for
    # (137.4 + 10.7) GFLOPs, so intensity tends to 110 < 156 as B grows: never.
    assert critical_batch_size(LLAMA2, CHAPTER_A100, context=4096) is None


def test_decode_attention_intensity_is_the_gqa_group():
    """QK^T in decode: 2 x L x 64 x 128 FLOPs over L x 8 x 128 x 2 bytes of K
    (+ the query): intensity = 64 / 8 = 8 heads per KV head (chapter: ~0.5)."""
    rows = {r.name: r for r in phase_table(LLAMA2, GPUS["H100"], 512, 1, 4096)}
    flops = 2 * 4096 * 64 * 128
    k_bytes = 4096 * 8 * 128 * 2 + 64 * 128 * 2
    assert rows["attn_score"].decode.op.intensity == pytest.approx(flops / k_bytes, rel=1e-9)
    assert rows["attn_score"].decode.bound == "memory"


def test_prefill_gemm_intensity():
    """qkv_proj over N tokens: 2 N d o FLOPs, 2 d o weight bytes, 2 N d input and
    2 N q output bytes (K, V go to the cache: 2 N 2 kv bytes)."""
    n, d, q, kv = 512, 8192, 8192, 1024
    rows = {r.name: r for r in phase_table(LLAMA2, GPUS["H100"], n, 1, 1)}
    flops = 2 * n * d * (q + 2 * kv)
    nbytes = 2 * d * (q + 2 * kv) + 2 * n * d + 2 * n * q + 2 * n * 2 * kv
    assert rows["qkv_proj"].prefill.op.intensity == pytest.approx(flops / nbytes, rel=1e-9)
    assert rows["qkv_proj"].prefill.bound == "compute"        # 460 > 295
    assert rows["qkv_proj"].decode.bound == "memory"


def test_batching_and_quantization_raise_the_bound():
    one = decode_bound(LLAMA2, GPUS["H100"], batch=1, context=1024)
    many = decode_bound(LLAMA2, GPUS["H100"], batch=64, context=1024)
    assert many.tokens_per_s > 30 * one.tokens_per_s
    int4 = decode_bound(LLAMA2, GPUS["H100"], 1, 1024, Precisions.parse(weight="int4"))
    # (137.4 GB weights + 0.34 GB KV) / (68.4B x 0.516 B + 0.52 GB bf16 head + 0.34 GB KV)
    assert int4.tokens_per_s / one.tokens_per_s == pytest.approx(3.8, abs=0.15)
    # Op-by-op time is never below the overlapped bound, and above it once some
    # ops are compute-bound (GEMMs at batch 512) while others are not (attention).
    assert many.serial_time >= many.whole.time * (1 - 1e-12)
    mixed = decode_bound(LLAMA2, GPUS["H100"], batch=512, context=1024)
    assert mixed.serial_time > 1.05 * mixed.whole.time


def test_multi_gpu_profile_scales_rates():
    eight = GPUS["H100"].times(8)
    assert eight.name == "8xH100"
    assert eight.memory_bandwidth == 8 * 3.35e12
    assert eight.critical_intensity() == pytest.approx(GPUS["H100"].critical_intensity())
    assert GPUS["A100"].times(2).fp8_flops is None

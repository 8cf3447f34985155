import pytest
import torch

from slipstream.quant import kv_quant as KV


def _kv(t=40, h=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, h, d, generator=g) * torch.logspace(-1, 1, t)[:, None, None]


def test_int8_per_token_per_head_error_is_half_a_step():
    x = _kv()
    q, s = KV.quantize_kv_int8(x)
    assert q.dtype == torch.int8 and s.shape == (40, 2)
    err = (KV.dequantize_kv_int8(q, s) - x).abs()
    assert (err <= s[..., None] / 2 + 1e-6).all()
    # A token's codes do not depend on the other tokens (quantized once, at store).
    q1, s1 = KV.quantize_kv_int8(x[7:8])
    assert torch.equal(q1, q[7:8]) and torch.equal(s1, s[7:8])


def test_fp8_relative_error_and_dtype():
    x = _kv()
    q, s = KV.quantize_kv_fp8(x)
    assert q.dtype == torch.float8_e4m3fn
    rel = (KV.dequantize_kv_fp8(q, s) - x).norm() / x.norm()
    assert rel < 0.04
    assert KV.fake_quantize_kv(x, "fp8").dtype == x.dtype
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        KV.fake_quantize_kv(x, "int4")


def test_kivi_keeps_the_recent_window_exact_and_keys_per_channel():
    k, v = _kv(seed=1), _kv(seed=2)
    k[:, :, 3] += 20.0                      # a key outlier channel
    kq, vq = KV.kivi_fake_quantize(k, v, bits=4, group=16, residual=8)
    # 40 tokens, keep >= 8 exact: groups cover tokens [0, 32); [32, 40) exact.
    assert torch.equal(kq[32:], k[32:]) and torch.equal(vq[32:], v[32:])
    assert not torch.equal(kq[:32], k[:32])
    # Per-channel keys absorb the outlier channel: much lower error than per-token keys.
    from slipstream.quant.kivi import asym_dequantize, asym_quantize
    per_token = asym_dequantize(*asym_quantize(k[:32], 4, dim=-1))
    assert (kq[:32] - k[:32]).norm() < 0.5 * (per_token - k[:32]).norm()
    k2, _ = KV.kivi_fake_quantize(k, v, bits=2, group=16)
    assert (k2[:32] - k[:32]).norm() > (kq[:32] - k[:32]).norm()


def test_bytes_per_token():
    assert KV.kv_bytes_per_token_head(128, "int8") == 132
    assert KV.kv_bytes_per_token_head(128, "auto") == 256

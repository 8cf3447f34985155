"""KIVI 2/4-bit KV cache: the numerics (quant/kivi.py) and the paged layout
(cache/kivi_cache.py), plain PyTorch on the CPU."""
import pytest
import torch
import torch.nn.functional as F

from slipstream.cache.kivi_cache import KIVICache
from slipstream.quant.kivi import (
    asym_dequantize, asym_quantize, kivi_causal_attention, kivi_fake_quantize)


def _kv(t=100, h=2, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(t, h, d, generator=g)
    k[:, :, 5] += 8.0      # a key outlier channel, as in real models
    return k, torch.randn(t, h, d, generator=g)


@pytest.mark.parametrize("bits", [2, 4])
def test_asym_error_within_half_a_step(bits):
    x = torch.randn(33, 4, 64)
    codes, scale, zero = asym_quantize(x, bits, dim=0)
    assert codes.max() <= 2 ** bits - 1 and scale.dtype == torch.float16
    err = (asym_dequantize(codes, scale, zero) - x).abs()
    assert (err <= scale.float() / 2 + 1e-3 * x.abs().amax(0, keepdim=True)).all()


@pytest.mark.parametrize("bits,residual", [(4, 0), (2, 0), (4, 24)])
def test_paged_cache_returns_the_reference_numerics(bits, residual):
    k, v = _kv()
    cache = KIVICache(8, 2, 64, bits, group=16, residual=residual, dtype=torch.float32)
    cache.add("a")
    start = 0
    for n in (1, 7, 30, 1, 1, 17, 43):     # prompt chunks, then decode-sized steps
        cache.append("a", k[start:start + n], v[start:start + n])
        start += n
        got_k, got_v = cache.read("a")
        want_k, want_v = kivi_fake_quantize(k[:start], v[:start], bits, 16, residual)
        torch.testing.assert_close(got_k, want_k, atol=1e-6, rtol=0)
        torch.testing.assert_close(got_v, want_v, atol=1e-6, rtol=0)
        # The window: tokens not in complete groups, or among the last `residual`, exact.
        exact_from = max(0, (start - residual) // 16 * 16)
        assert torch.equal(got_k[exact_from:], k[exact_from:start])
        assert len(cache.pages["a"]) == exact_from // 16
    cache.release("a")
    assert len(cache.free) == 8


def test_keys_per_channel_beat_keys_per_token_on_outlier_channels():
    k, v = _kv()
    kq, _ = kivi_fake_quantize(k, v, 4, group=32)
    per_token = asym_dequantize(*asym_quantize(k[:96], 4, dim=-1))
    assert (kq[:96] - k[:96]).norm() < 0.5 * (per_token - k[:96]).norm()
    k2, _ = kivi_fake_quantize(k, v, 2, group=32)
    assert (k2[:96] - k[:96]).norm() > (kq[:96] - k[:96]).norm()


def test_causal_reference_matches_attention_over_the_cache_at_each_step():
    """Query t of a prompt sees what a decode step at t would read from the cache."""
    k, v = _kv(t=40, h=2, d=32, seed=3)
    q = torch.randn(40, 4, 32)
    out = kivi_causal_attention(q, k, v, 0.2, bits=2, group=8, residual=4)
    cache = KIVICache(8, 2, 32, 2, group=8, residual=4, dtype=torch.float32)
    cache.add("s")
    for t in range(40):
        cache.append("s", k[t:t + 1], v[t:t + 1])
        kk, vv = cache.read("s")
        o = F.scaled_dot_product_attention(q[t:t + 1].transpose(0, 1), kk.transpose(0, 1),
                                           vv.transpose(0, 1), scale=0.2, enable_gqa=True)
        torch.testing.assert_close(out[t], o.transpose(0, 1)[0], atol=1e-5, rtol=1e-5)
    # and it is not the exact attention
    exact = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           is_causal=True, scale=0.2, enable_gqa=True).transpose(0, 1)
    assert (out - exact).abs().max() > 1e-3


def test_storage_per_token():
    cache = KIVICache(4, 8, 128, 4, group=32, dtype=torch.float16)
    # K: 128 ch x (32 tokens x 4 bits = 16 B) + fp16 scale and zero per channel, / 32 tokens;
    # V: 64 B codes + 4 channel groups x 4 B per token. Per KV head: 160 B (fp16: 512).
    assert cache.bytes_per_token() == 8 * ((128 * 16 + 128 * 4) / 32 + 64 + 16)
    cache2 = KIVICache(4, 8, 128, 2, group=32)
    assert cache2.bytes_per_token() == 0.6 * cache.bytes_per_token()   # 96 B per KV head
    cache.add("x")
    cache.append("x", torch.randn(40, 8, 128), torch.randn(40, 8, 128))
    assert cache.bytes_per_token("x") > cache.bytes_per_token()   # 8 tokens still in fp16


def test_bad_shapes_named():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        KIVICache(4, 2, 64, 3)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kivi_fake_quantize(torch.randn(4, 1, 8), torch.randn(4, 1, 8), 8)

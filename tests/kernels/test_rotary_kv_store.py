"""Fused rotary + KV store against its twin (`reference.rotary_store_kv`: the
in-place rotary, then the KV store) and against the two unfused kernels."""
import pytest
import torch

from slipstream.kernels import reference
from slipstream.kernels.kv_store import store_kv
from slipstream.kernels.rotary import rotary_inplace
from slipstream.kernels.rotary_kv_store import rotary_store_kv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(dtype, num_tokens, heads, kv_heads, head_dim, page_size, cache_dtype=None):
    from slipstream.layers.rotary import RotaryEmbedding
    torch.set_default_dtype(dtype)
    try:
        rope = RotaryEmbedding(head_dim, 256, 10000.0).to(DEVICE)
    finally:
        torch.set_default_dtype(torch.float32)
    qkv = (torch.randn(num_tokens, heads + 2 * kv_heads, head_dim) * 3).to(dtype).to(DEVICE)
    positions = torch.randint(0, 256, (num_tokens,), device=DEVICE)
    num_blocks = -(-num_tokens // page_size) + 2
    slots = torch.randperm(num_blocks * page_size)[:num_tokens].to(DEVICE)
    if num_tokens > 2:
        slots[1] = -1  # a padding token: rotated, not stored
    shape = (num_blocks, page_size, kv_heads, head_dim)
    if cache_dtype is None:
        caches = [torch.full(shape, float("nan"), dtype=dtype, device=DEVICE) for _ in range(2)]
        scales = [None, None]
    else:
        caches = [torch.zeros(shape, dtype=cache_dtype, device=DEVICE) for _ in range(2)]
        scales = [torch.full(shape[:3], -1.0, device=DEVICE) for _ in range(2)]
    return rope, qkv, positions, slots, caches, scales


def _views(qkv, heads, kv_heads):
    return qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]


def _assert_same(got, want, exact=True):
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("num_tokens,heads,kv_heads,head_dim,page_size", [
    (1, 32, 8, 64, 16),    # a decode token, GQA 4, two q-head blocks
    (7, 8, 2, 32, 8),      # several tokens and pages
    (5, 20, 4, 80, 16),    # head dim not a power of two, a partial q-head block
    (3, 3, 3, 16, 4),      # MHA, odd head counts
])
def test_rotary_store_matches_twin(dtype, num_tokens, heads, kv_heads, head_dim, page_size):
    rope, qkv, positions, slots, caches, _ = _case(dtype, num_tokens, heads, kv_heads, head_dim,
                                                   page_size)
    twin_qkv, twin_caches = qkv.clone(), [c.clone() for c in caches]
    reference.rotary_store_kv(*_views(twin_qkv, heads, kv_heads), positions, rope.cos, rope.sin,
                              *twin_caches, slots)
    want_qkv, want_caches = qkv.clone(), [c.clone() for c in caches]
    rotary_inplace(want_qkv[:, :heads + kv_heads], positions, rope.cos, rope.sin)
    store_kv(*_views(want_qkv, heads, kv_heads)[1:], *want_caches, slots)
    rotary_store_kv(*_views(qkv, heads, kv_heads), positions, rope.cos, rope.sin, *caches, slots)
    # The kernel rounds as the unfused kernels do: exact against them.
    torch.testing.assert_close(qkv, want_qkv, atol=0, rtol=0)
    _assert_same(caches, want_caches, exact=True)
    # The twin's fp32 multiply-adds may round the last bit differently.
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0, rtol=0)
    torch.testing.assert_close(qkv, twin_qkv, **tol)
    for c, t in zip(caches, twin_caches):
        torch.testing.assert_close(c, t, equal_nan=True, **tol)
    assert not caches[0].view(-1, kv_heads, head_dim)[slots[slots >= 0]].isnan().any()


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_rotary_store_quantized_cache(fmt):
    """Codes and scales equal those of the unfused kernels (rotary, then KV store)."""
    from slipstream.quant.kv_quant import KV_FORMATS
    heads, kv_heads, d = 8, 2, 64
    rope, qkv, positions, slots, caches, scales = _case(torch.float16, 6, heads, kv_heads, d, 8,
                                                        KV_FORMATS[fmt].storage)
    before, want_qkv = qkv.clone(), qkv.clone()
    want = [c.clone() for c in caches] + [s.clone() for s in scales]
    q, k, v = _views(want_qkv, heads, kv_heads)
    rotary_inplace(want_qkv[:, :heads + kv_heads], positions, rope.cos, rope.sin)
    store_kv(k, v, want[0], want[1], slots, want[2], want[3])
    rotary_store_kv(*_views(qkv, heads, kv_heads), positions, rope.cos, rope.sin, *caches, slots,
                    *scales)
    torch.testing.assert_close(qkv, want_qkv, atol=0, rtol=0)
    _assert_same(caches + scales, want, exact=True)
    assert (scales[0].flatten(0, 1)[slots[slots >= 0]] > 0).all()
    # and near the torch twin's quantization (kv_quant's rounding)
    twin = [c.clone().zero_() for c in caches] + [torch.full_like(s, -1.0) for s in scales]
    reference.rotary_store_kv(*_views(before, heads, kv_heads), positions, rope.cos, rope.sin,
                              twin[0], twin[1], slots, twin[2], twin[3])
    torch.testing.assert_close(scales[0], twin[2], rtol=1e-6, atol=0)


def test_rotary_store_rejects_odd_head_dim():
    x = torch.randn(2, 4, 7)
    cache = torch.zeros(3, 4, 2, 7)
    with pytest.raises(ValueError, match="even head_dim"):
        rotary_store_kv(x, x[:, :2], x[:, 2:], torch.zeros(2, dtype=torch.long), torch.zeros(8, 7),
                        torch.zeros(8, 7), cache, cache.clone(), torch.zeros(2, dtype=torch.long))

"""KV store kernel against `reference.store_kv`: exact (a copy, with a cast)."""
import pytest
import torch

from slipstream.kernels import reference
from slipstream.kernels.kv_store import store_kv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("page_size,num_kv_heads,head_dim,src_dtype", [
    (16, 2, 64, torch.float16),
    (32, 8, 128, torch.float32),   # cast fp32 -> fp16 cache
    (8, 3, 80, torch.float16),     # odd head count, head dim not a power of two
])
def test_store_kv_matches_reference(page_size, num_kv_heads, head_dim, src_dtype):
    num_blocks, num_tokens = 7, 23
    k = torch.randn(num_tokens, num_kv_heads, head_dim, dtype=src_dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, dtype=src_dtype)
    slots = torch.randperm(num_blocks * page_size)[:num_tokens]
    slots[[3, 11]] = -1  # padding tokens are skipped
    shape = (num_blocks, page_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=torch.float16)
    v_cache = torch.full(shape, float("nan"), dtype=torch.float16)
    k, v, slots, k_cache, v_cache = (x.to(DEVICE) for x in (k, v, slots, k_cache, v_cache))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv(k, v, k_cache, v_cache, slots)
    reference.store_kv(k, v, k_ref, v_ref, slots)
    # NaN marks untouched slots in both: compare them as equal.
    torch.testing.assert_close(k_cache, k_ref, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, v_ref, atol=0, rtol=0, equal_nan=True)


def test_store_kv_strided_inputs():
    """k/v as views into a fused qkv projection (token stride > heads * dim)."""
    qkv = torch.randn(9, 4 + 2 + 2, 32, dtype=torch.float16, device=DEVICE)
    k, v = qkv[:, 4:6], qkv[:, 6:8]
    k_cache = torch.full((3, 16, 2, 32), float("nan"), dtype=torch.float16, device=DEVICE)
    v_cache = k_cache.clone()
    slots = torch.arange(9, device=DEVICE) * 5
    store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(-1, 2, 32)[slots], k)
    assert torch.equal(v_cache.view(-1, 2, 32)[slots], v)

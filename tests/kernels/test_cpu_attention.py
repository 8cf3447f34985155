"""CPU decode attention over the paged cache against the reference (gather + SDPA)."""
import pytest
import torch

from slipstream.kernels import cpu_attention, cpu_library, cpu_reference

if cpu_library.load() is None:
    pytest.skip(f"CPU kernels unavailable: {cpu_library.error()}", allow_module_level=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5])
def test_decode_attention_matches_reference(dtype, window):
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, bs, blocks = 6, 2, 32, 4, 24
    k_cache = torch.randn(blocks, bs, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(blocks, bs, kv_heads, dim, generator=gen).to(dtype)
    seq_lens = [1, 9, 17]
    tables = torch.randperm(blocks, generator=gen)[:15].view(3, 5).to(torch.int32)
    q = torch.randn(3, heads, dim, generator=gen)
    out = cpu_attention.decode_attention(q, k_cache, v_cache, torch.tensor(seq_lens, dtype=torch.int32),
                                         tables, 0.3, window)
    ref = cpu_reference.decode_attention(q, k_cache.float(), v_cache.float(), seq_lens, tables, 0.3, window)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)   # fp32 inside both


@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("threads", [1, 3])
def test_long_contexts_and_large_head_groups(window, threads):
    """Keys over several 64-key tiles, 10 query heads a KV head (more than one
    chunk's group of 8); the head groups a chunk takes depend on the threads."""
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, dim, bs, blocks = 20, 2, 64, 16, 32
    k_cache = torch.randn(blocks, bs, kv_heads, dim, generator=gen)
    v_cache = torch.randn(blocks, bs, kv_heads, dim, generator=gen)
    seq_lens = [150, 70, 3]
    tables = torch.randperm(blocks, generator=gen)[:30].view(3, 10).to(torch.int32)
    q = torch.randn(3, heads, dim, generator=gen)
    before = cpu_library.set_threads(None)
    try:
        cpu_library.set_threads(threads)
        out = cpu_attention.decode_attention(q, k_cache, v_cache, torch.tensor(seq_lens, dtype=torch.int32),
                                             tables, 0.125, window)
    finally:
        cpu_library.set_threads(before)
    ref = cpu_reference.decode_attention(q, k_cache, v_cache, seq_lens, tables, 0.125, window)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_then_attend_in_one_call(dtype):
    """The new K/V (strided views, as the model passes them) are written to their
    slots exactly as reference.store_kv writes them, then attended."""
    from slipstream.kernels import reference
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, dim, bs, blocks = 4, 2, 16, 4, 12
    caches = [torch.randn(blocks, bs, kv_heads, dim, generator=gen).to(dtype) for _ in range(2)]
    ref_caches = [c.clone() for c in caches]
    tables = torch.tensor([[3, 7, 1], [0, 5, 9]], dtype=torch.int32)
    seq_lens = torch.tensor([10, 5], dtype=torch.int32)
    slots = torch.tensor([7 * bs + 1, 5 * bs + 0])       # positions 9 and 4
    qkv = torch.randn(2, heads + 2 * kv_heads, dim, generator=gen)
    q, k, v = qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]
    out = cpu_attention.decode_attention(q, caches[0], caches[1], seq_lens, tables, 0.25, None, k, v, slots)
    reference.store_kv(k, v, ref_caches[0], ref_caches[1], slots)
    assert torch.equal(caches[0], ref_caches[0]) and torch.equal(caches[1], ref_caches[1])
    ref = cpu_reference.decode_attention(q, ref_caches[0].float(), ref_caches[1].float(), [10, 5], tables, 0.25)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)

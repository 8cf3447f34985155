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


def _tree(n: int, gen) -> torch.Tensor:
    """A random tree over n step tokens (token 0 the root): [n, n] ancestor-or-self mask."""
    parent = [0] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while True:
            mask[i, j] = True
            if j == 0:
                break
            j = parent[j]
    return mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tree,window", [(False, None), (True, None), (True, 7), (False, 70)])
@pytest.mark.parametrize("threads", [1, 3])
def test_tree_attention_matches_reference(dtype, tree, window, threads):
    """Several tokens a sequence (a chain, causal, or a tree) stored at their slots,
    then attending to the context and to the step's tokens the mask allows; three
    sequences of different lengths (one context over several 64-key tiles, one
    bringing 16 tokens, one a single token), 5 query heads a KV head."""
    from slipstream.kernels import reference
    gen = torch.Generator().manual_seed(7)
    heads, kv_heads, dim, bs, blocks = 10, 2, 32, 8, 64
    k_cache = torch.randn(blocks, bs, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(blocks, bs, kv_heads, dim, generator=gen).to(dtype)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    qlens, ctx = [9, 16, 1], [150, 3, 20]
    seq_lens = [c + n for c, n in zip(ctx, qlens)]
    tables = torch.randperm(blocks, generator=gen)[:60].view(3, 20).to(torch.int32)
    slots = torch.tensor([int(tables[s, p // bs]) * bs + p % bs
                          for s in range(3) for p in range(ctx[s], seq_lens[s])])
    width = max(qlens)
    mask = torch.ones(3, width, width, dtype=torch.bool).tril_()
    if tree:
        for s, n in enumerate(qlens):
            mask[s, :n, :n] = _tree(n, gen)
    n = sum(qlens)
    qkv = torch.randn(n, heads + 2 * kv_heads, dim, generator=gen)
    q, k, v = qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]
    before = cpu_library.set_threads(None)
    try:
        cpu_library.set_threads(threads)
        out = cpu_attention.tree_attention(q, k_cache, v_cache, torch.tensor(seq_lens, dtype=torch.int32),
                                           tables, qlens, 0.2, window, mask if tree else None, k, v, slots)
    finally:
        cpu_library.set_threads(before)
    reference.store_kv(k, v, ref_k, ref_v, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    loc = [0, 9, 25, 26]
    ref = reference.paged_attention(q, ref_k.float(), ref_v.float(), loc, seq_lens, tables, 0.2, window,
                                    mask if tree else None)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    if tree:   # the mask matters: causal attention gives other rows
        causal = reference.paged_attention(q, ref_k.float(), ref_v.float(), loc, seq_lens, tables, 0.2, window)
        assert (out - causal).abs().max() > 1e-2


def test_tree_attention_rejects_long_queries():
    with pytest.raises(ValueError, match="query_lens"):
        cpu_attention.query_masks([65], None)

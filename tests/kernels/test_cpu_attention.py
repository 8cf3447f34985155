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

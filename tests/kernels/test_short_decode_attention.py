"""Short-context decode kernel against `reference.decode_attention` (fp32 on
upcast inputs), on every path: the peeled first tile alone, the tile loop after
it, pages smaller and larger than the tile, GQA groups, int8 / fp8 caches.
Caches are NaN outside the written slots and outputs start as NaN."""
import pytest
import torch

from slipstream.kernels import reference
from slipstream.kernels.short_decode_attention import short_decode_attention

from tests.kernels.conftest import quantized_cache

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float16: 4e-3, torch.float32: 2e-5, torch.bfloat16: 3e-2}


def _run(b, dtype, config=None, **scales):
    d = b.q.shape[-1]
    out = torch.full(b.q.shape, float("nan"), dtype=dtype, device=b.q.device)
    short_decode_attention(b.q, *scales.pop("caches", (b.k_cache, b.v_cache)), b.seq_lens,
                           b.block_tables, d ** -0.5, out=out, config=config, **scales)
    return out


@pytest.mark.parametrize("group,page_size,block_n", [
    (1, 16, 16),    # MHA, one page a tile
    (4, 8, 32),     # GQA 4, several pages a tile (one block-table entry a key)
    (8, 32, 16),    # GQA 8, a page holds several tiles (one entry a tile)
])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("early_kv", [True, False])
def test_short_decode_matches_reference(paged_batch, close, group, page_size, block_n, dtype,
                                        early_kv):
    # seq_len 1, within the first tile, the new token the tile's last key, the
    # new token the first after the tile, several tiles.
    b = paged_batch([0, 5, block_n - 1, block_n, 3 * block_n + 7], [1] * 5, 8, 8 // group, 64,
                    page_size, dtype=dtype, device=DEVICE)
    out = _run(b, dtype, {"BLOCK_N": block_n, "EARLY_KV": early_kv})
    ref = reference.decode_attention(b.q.float(), b.k_cache.float(), b.v_cache.float(),
                                     b.seq_lens, b.block_tables, 0.125)
    close(out, ref, TOL[dtype], TOL[dtype])


def test_short_decode_odd_head_dim(paged_batch, close):
    """A head dim that is not a power of two is padded and masked."""
    b = paged_batch([9, 40], [1, 1], 4, 2, 48, 16, device=DEVICE)
    out = _run(b, torch.float16)
    ref = reference.decode_attention(b.q.float(), b.k_cache.float(), b.v_cache.float(),
                                     b.seq_lens, b.block_tables, 48 ** -0.5)
    close(out, ref, 4e-3, 4e-3)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("early_kv", [True, False])
def test_short_decode_quantized_cache(paged_batch, close, fmt, early_kv):
    b = paged_batch([4, 20, 31, 70], [1] * 4, 8, 2, 64, 16, device=DEVICE)
    kc, ks, vc, vs = quantized_cache(b, fmt)
    out = _run(b, torch.float16, {"BLOCK_N": 32, "EARLY_KV": early_kv}, caches=(kc, vc),
               k_scale=ks, v_scale=vs)
    ref = reference.decode_attention(b.q.float(), kc, vc, b.seq_lens, b.block_tables, 0.125,
                                     k_scale=ks, v_scale=vs)
    close(out, ref, 4e-3, 4e-3)


@pytest.mark.parametrize("early_kv", [True, False])
def test_short_decode_empty_row_writes_zeros(paged_batch, early_kv):
    """A row of length 0 gets zeros, not NaN."""
    b = paged_batch([10, 3], [1, 1], 4, 1, 64, 16, device=DEVICE)
    b.seq_lens[1] = 0
    out = _run(b, torch.float16, {"EARLY_KV": early_kv})
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert not out[0].isnan().any()


def test_short_decode_rejects_bad_heads(paged_batch):
    b = paged_batch([3], [1], 6, 4, 64, 16, device=DEVICE)
    with pytest.raises(ValueError, match="num_kv_heads"):
        _run(b, torch.float16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 dots need a GPU (interpreter limit)")
def test_short_decode_bf16_on_gpu(paged_batch, close):
    b = paged_batch([0, 130, 300, 1000], [1] * 4, 32, 8, 128, 16, dtype=torch.bfloat16,
                    device=DEVICE)
    out = _run(b, torch.bfloat16)
    ref = reference.decode_attention(b.q.float(), b.k_cache.float(), b.v_cache.float(),
                                     b.seq_lens, b.block_tables, 128 ** -0.5)
    close(out, ref, TOL[torch.bfloat16], TOL[torch.bfloat16])

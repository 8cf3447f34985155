"""Decode (split-KV) kernel against `reference.decode_attention` (fp32 on upcast inputs).

Tolerances (max abs and rel error): fp16 4e-3, fp32 2e-5 (full-precision dots),
bf16 3e-2 (GPU only).
Outputs start as NaN; caches are NaN outside the written slots.
"""
import pytest
import torch

from slipstream.kernels import reference
from slipstream.kernels.decode_attention import (
    DEEP_PER_SM, MIN_TOKENS_PER_SPLIT, UNSPLIT_MAX_LEN, choose_num_splits, decode_attention)
from slipstream.kernels.kv_store import store_kv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float16: 4e-3, torch.float32: 2e-5, torch.bfloat16: 3e-2}
# seq_len 1 (empty context), lengths off the tile and page sizes.
CONTEXTS = [0, 6, 40, 99]


def _check(b, close, splits, window=None, dtype=torch.float16, config=None):
    d = b.q.shape[-1]
    out = torch.full(b.q.shape, float("nan"), dtype=dtype, device=b.q.device)
    decode_attention(b.q, b.k_cache, b.v_cache, b.seq_lens, b.block_tables, d ** -0.5,
                     max_seq_len=int(b.seq_lens.max()), sliding_window=window,
                     num_splits=splits, out=out, config=config)
    ref = reference.decode_attention(b.q.float(), b.k_cache.float(), b.v_cache.float(),
                                     b.seq_lens, b.block_tables, d ** -0.5, window)
    close(out, ref, TOL[dtype], TOL[dtype])


@pytest.mark.parametrize("group,page_size,splits", [
    (1, 16, 1),     # MHA, one split writes the output directly
    (4, 32, 3),     # GQA 4, splits merged (not a power of two)
    (8, 8, 4),      # GQA 8, pages smaller than the KV tile
])
def test_decode_gqa_splits(paged_batch, close, group, page_size, splits):
    b = paged_batch(CONTEXTS, [1] * 4, 8, 8 // group, 64, page_size, device=DEVICE)
    _check(b, close, splits)


@pytest.mark.parametrize("short", [True, False])
def test_decode_unsplit_kernels(paged_batch, close, short):
    """One split: the short-context kernel (the default up to SHORT_MAX_LEN) and
    the split kernel writing its output directly."""
    b = paged_batch(CONTEXTS, [1] * 4, 8, 2, 64, 16, device=DEVICE)
    _check(b, close, 1, config={"SHORT": short})


def test_decode_more_splits_than_tiles(paged_batch, close):
    """Short requests leave some splits empty; the merge must ignore them."""
    b = paged_batch([0, 2], [1, 1], 4, 2, 128, 16, device=DEVICE)
    _check(b, close, 8)


def test_decode_sliding_window(paged_batch, close):
    b = paged_batch(CONTEXTS, [1] * 4, 4, 1, 64, 16, device=DEVICE)
    _check(b, close, 2, window=19)


def test_decode_fp32_is_exact(paged_batch, close):
    """An fp32 engine must not lose precision to tf32 dots."""
    b = paged_batch([0, 37, 70], [1] * 3, 8, 2, 64, 16, dtype=torch.float32, device=DEVICE)
    _check(b, close, 2, dtype=torch.float32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 dots need a GPU (interpreter limit)")
def test_decode_bf16_on_gpu(paged_batch, close):
    b = paged_batch([0, 300, 4000, 77], [1] * 4, 32, 8, 128, 16, dtype=torch.bfloat16, device=DEVICE)
    _check(b, close, None, dtype=torch.bfloat16)


def test_choose_num_splits_fills_the_gpu():
    # One long request: split until one wave fills every SM's program slots.
    s = choose_num_splits(1, 8, 32768, sm_count=132)
    assert 8 * s <= DEEP_PER_SM * 132 < 8 * (s + 1)
    # A large batch already fills the GPU: no split.
    assert choose_num_splits(64, 8, 4096, sm_count=132) == 1
    # Splits are not shorter than MIN_TOKENS_PER_SPLIT; short contexts stay whole.
    assert choose_num_splits(1, 8, 1000, sm_count=132) == -(-1000 // MIN_TOKENS_PER_SPLIT)
    assert choose_num_splits(1, 8, UNSPLIT_MAX_LEN, sm_count=132) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="programmatic dependent launch needs a GPU")
def test_chained_launches_see_the_kernel_before(paged_batch, close):
    """On Hopper the split kernel may start before the kernel ahead of it ends.
    It must still see that kernel's writes: the KV store's new token (the cache
    slot is NaN until then) and the previous call's output, used here as the
    next call's query. Nothing runs between the three launches."""
    b = paged_batch([300, 4000, 77, 1000], [1] * 4, 32, 8, 128, 16, device=DEVICE, store_new=False)
    d = b.q.shape[-1]
    max_len = int(b.seq_lens.max())
    assert choose_num_splits(4, 8, max_len, group=4) > 1  # the merge kernel runs too

    def attend(q):  # every argument ready: no kernel of torch's between ours
        return decode_attention(q, b.k_cache, b.v_cache, b.seq_lens, b.block_tables, d ** -0.5,
                                max_seq_len=max_len, cu_seqlens_q=b.cu_seqlens_q)
    torch.cuda.synchronize()
    store_kv(b.k, b.v, b.k_cache, b.v_cache, b.slot_mapping)
    first = attend(b.q)
    second = attend(first)
    for q, out in ((b.q, first), (first, second)):
        ref = reference.decode_attention(q.float(), b.k_cache.float(), b.v_cache.float(),
                                         b.seq_lens, b.block_tables, d ** -0.5)
        close(out, ref, TOL[torch.float16], TOL[torch.float16])

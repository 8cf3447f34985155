"""Quantized KV caches (int8 / fp8 e4m3 codes, one fp32 scale per token and head):
the store kernel against `reference.store_kv`, and the decode, tree and prefill
kernels reading the codes against their twins reading the same cache
(`reference.*` dequantize it in fp32).

Tolerances (max abs and rel error of the attention output): fp16 activations
4e-3 (P x v_scale is rounded to fp16 before the P.V dot), fp32 1e-4. Outputs start
as NaN; scales of unwritten slots are NaN, so a kernel that reads them fails.
"""
import pytest
import torch

from slipstream.kernels import reference
from slipstream.kernels.decode_attention import decode_attention
from slipstream.kernels.kv_store import store_kv
from slipstream.kernels.prefill_attention import prefill_attention
from slipstream.quant.kv_quant import KV_FORMATS, dequantize_kv
from tests.kernels.conftest import check_quantized_tree, quantized_cache

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float16: 4e-3, torch.float32: 1e-4}
FORMATS = ["int8", "fp8"]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_store_quantizes_like_the_reference(fmt, dtype):
    g = torch.Generator().manual_seed(0)
    t, h, d, page = 9, 3, 40, 8   # odd head count and a head dim off the power of two
    k = (torch.randn(t, h, d, generator=g) * torch.logspace(-2, 2, t)[:, None, None]).to(dtype)
    v = torch.randn(t, h, d, generator=g).to(dtype)
    slots = torch.tensor([3, 17, -1, 0, 8, 30, 31, 12, 5])
    caches = []
    for store in (store_kv, reference.store_kv):
        kc = torch.zeros(5, page, h, d, dtype=KV_FORMATS[fmt].storage, device=DEVICE)
        vc = torch.zeros_like(kc)
        ks = torch.full((5, page, h), -1.0, device=DEVICE)
        vs = torch.full_like(ks, -1.0)
        store(k.to(DEVICE), v.to(DEVICE), kc, vc, slots.to(DEVICE), ks, vs)
        caches.append(tuple(x.cpu() for x in (kc, vc, ks, vs)))
    (kc, vc, ks, vs), (rkc, rvc, rks, rvs) = caches
    torch.testing.assert_close(ks, rks, rtol=1e-6, atol=0)
    torch.testing.assert_close(vs, rvs, rtol=1e-6, atol=0)
    assert (ks.flatten(0, 1)[slots[slots >= 0]] > 0).all()
    assert (ks.flatten(0, 1)[[1, 2, 4]] == -1).all()         # untouched slots stay
    # Same codes (fp8: one e4m3 step apart at most, where rounding ties differ).
    step = 1.0 if fmt == "int8" else 2 ** -3
    for a, r, s in ((kc, rkc, ks), (vc, rvc, vs)):
        diff = (a.float() - r.float()).abs()
        assert (diff <= step * r.float().abs().clamp_min(1) + 1e-6).all()
        assert (diff == 0).float().mean() > 0.99
    # Round trip: half a step (int8) or 2^-4 relative (e4m3, 3 mantissa bits).
    back = dequantize_kv(kc.flatten(0, 1)[slots[slots >= 0]], ks.flatten(0, 1)[slots[slots >= 0]])
    x = k[slots >= 0].float()
    if fmt == "int8":
        assert ((back - x).abs() <= ks.flatten(0, 1)[slots[slots >= 0]][..., None] * 0.5 + 1e-6).all()
    else:
        assert ((back - x).abs() <= x.abs() * 2 ** -4 + ks.flatten(0, 1)[slots[slots >= 0]][..., None] * 2 ** -9).all()


def _decode(b, fmt, dtype, splits, window=None):
    kc, ks, vc, vs = quantized_cache(b, fmt)
    q = b.q.to(dtype)
    out = torch.full(q.shape, float("nan"), dtype=dtype, device=q.device)
    decode_attention(q, kc, vc, b.seq_lens, b.block_tables, 0.125, max_seq_len=int(b.seq_lens.max()),
                     sliding_window=window, num_splits=splits, out=out, k_scale=ks, v_scale=vs)
    ref = reference.decode_attention(q.float(), kc, vc, b.seq_lens, b.block_tables, 0.125, window,
                                     k_scale=ks, v_scale=vs)
    return out, ref


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("group,page_size,splits,dtype", [
    (1, 16, 1, torch.float16), (4, 32, 3, torch.float16), (8, 8, 4, torch.float32)])
def test_decode_reads_quantized_cache(paged_batch, close, fmt, group, page_size, splits, dtype):
    b = paged_batch([0, 6, 40, 99], [1] * 4, 8, 8 // group, 64, page_size, device=DEVICE)
    out, ref = _decode(b, fmt, dtype, splits)
    close(out, ref, TOL[dtype], TOL[dtype])


def test_decode_quantized_sliding_window(paged_batch, close):
    b = paged_batch([0, 6, 40, 99], [1] * 4, 4, 1, 64, 16, device=DEVICE)
    out, ref = _decode(b, "int8", torch.float16, 2, window=19)
    close(out, ref, TOL[torch.float16], TOL[torch.float16])


@pytest.mark.parametrize("fmt,tol", [("int8", 0.02), ("fp8", 0.08)])
def test_quantized_decode_stays_near_the_16_bit_cache(paged_batch, fmt, tol):
    """What the quantization itself costs: against attention over the exact cache."""
    b = paged_batch([50, 99], [1, 1], 8, 2, 64, 16, dtype=torch.float32, device=DEVICE)
    out, _ = _decode(b, fmt, torch.float32, 2)
    exact = reference.decode_attention(b.q, b.k_cache, b.v_cache, b.seq_lens, b.block_tables, 0.125)
    err = (out - exact).norm() / exact.norm()
    assert 0 < err < tol


@pytest.mark.parametrize("fmt", FORMATS)
def test_tree_reads_quantized_cache(paged_batch, close, fmt):
    check_quantized_tree(paged_batch, close, fmt, DEVICE)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("new_kv", [True, False])
def test_prefill_reads_quantized_context(paged_batch, close, fmt, new_kv):
    """Cached context from codes; the step's own keys fresh (new_kv) or from the cache."""
    b = paged_batch([0, 21, 3], [17, 40, 5], 8, 2, 64, 16, device=DEVICE)
    kc, ks, vc, vs = quantized_cache(b, fmt)
    out = torch.full(b.q.shape, float("nan"), dtype=b.q.dtype, device=DEVICE)
    prefill_attention(b.q, b.k if new_kv else None, b.v if new_kv else None, kc, vc,
                      b.cu_seqlens_q, b.context_lens, b.block_tables, b.max_query_len, 0.125,
                      out=out, k_cache_scale=ks, v_cache_scale=vs)
    ref = reference.prefill_attention(
        b.q.float(), b.k.float() if new_kv else None, b.v.float() if new_kv else None, kc, vc,
        b.cu_seqlens_q, b.context_lens, b.block_tables, 0.125, k_cache_scale=ks, v_cache_scale=vs)
    close(out, ref, 4e-3, 4e-3)


def test_codes_without_scales_are_refused(paged_batch):
    b = paged_batch([5], [1], 2, 2, 64, 16, device=DEVICE)
    kc, _, vc, _ = quantized_cache(b, "int8")
    with pytest.raises(ValueError, match="k_scale"):
        decode_attention(b.q, kc, vc, b.seq_lens, b.block_tables, 0.125, max_seq_len=6)

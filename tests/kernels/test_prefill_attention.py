"""Prefill kernel against `reference.prefill_attention` (fp32 on upcast inputs).

Tolerances (max abs and rel error of the output): fp16 4e-3 (P is rounded to
fp16 before the P.V product), fp32 2e-3 (tf32 dot products on a GPU), bf16
3e-2 (GPU only: the CPU interpreter cannot run bf16 dots).
Outputs start as NaN; caches are NaN outside the written slots.
"""
import pytest
import torch

from slipstream.kernels import reference
from slipstream.kernels.prefill_attention import prefill_attention
from slipstream.kernels.prefill_configs import PAGED_LOADS
from tests.kernels.conftest import quantized_cache

TOL = {torch.float16: 4e-3, torch.float32: 2e-5, torch.bfloat16: 3e-2}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# One-token request, odd lengths, lengths off the 16-token tile, empty and cached context.
CONTEXTS = [0, 0, 21, 3]
QUERIES = [1, 17, 40, 5]


def _run(b, *, new_kv=True, causal=True, window=None, use_tma=None, dtype=torch.float16, config=None,
         paged_load=None):
    d = b.q.shape[-1]
    out = torch.full(b.q.shape, float("nan"), dtype=dtype, device=b.q.device)
    prefill_attention(b.q, b.k if new_kv else None, b.v if new_kv else None, b.k_cache, b.v_cache,
                      b.cu_seqlens_q, b.context_lens, b.block_tables, b.max_query_len, d ** -0.5,
                      causal=causal, sliding_window=window, out=out, use_tma=use_tma, config=config,
                      paged_load=paged_load)
    ref = reference.prefill_attention(
        b.q.float(), b.k.float() if new_kv else None, b.v.float() if new_kv else None,
        b.k_cache.float(), b.v_cache.float(), b.cu_seqlens_q, b.context_lens, b.block_tables,
        d ** -0.5, causal, window)
    return out, ref


@pytest.mark.parametrize("group,page_size,use_tma", [(1, 16, True), (4, 32, False), (8, 8, True)])
def test_varlen_gqa_paged_context(paged_batch, close, group, page_size, use_tma):
    b = paged_batch(CONTEXTS, QUERIES, 8 if group > 1 else 2, 8 // group if group > 1 else 2,
                    64, page_size, device=DEVICE)
    out, ref = _run(b, use_tma=use_tma)
    close(out, ref, TOL[torch.float16], TOL[torch.float16])


def test_all_keys_from_cache(paged_batch, close):
    """k=None: the step's keys are read back from the cache (paged-KV prefill)."""
    b = paged_batch(CONTEXTS, QUERIES, 4, 1, 64, 16, device=DEVICE)
    out, ref = _run(b, new_kv=False)
    close(out, ref, TOL[torch.float16], TOL[torch.float16])


# Pages smaller than, equal to and larger than the 16-key tile; TMA falls back to
# the prefetching gather when a page is smaller than a tile.
@pytest.mark.parametrize("paged_load,page_size,new_kv", [
    *((mode, 8, False) for mode in sorted(PAGED_LOADS)),
    *((mode, page, new_kv) for mode in ("prefetch32_lean", "tma_lean", "prefetch32_one_loop", "tma")
      for page, new_kv in ((16, True), (32, False)))])
def test_paged_load_modes(paged_batch, close, paged_load, page_size, new_kv):
    """Every way of fetching cached K/V tiles gives the same attention, masked
    tile edges (sequence ends off the tile, NaN in unwritten slots) included."""
    b = paged_batch([0, 21, 40, 3], [17, 40, 5, 33], 4, 2, 64, page_size, device=DEVICE)
    out, ref = _run(b, new_kv=new_kv, use_tma=True, paged_load=paged_load)
    close(out, ref, TOL[torch.float16], TOL[torch.float16])


@pytest.mark.parametrize("paged_load", ["prefetch32", "prefetch32_one_loop", "prefetch32_lean"])
def test_paged_load_modes_sliding_window(paged_batch, close, paged_load):
    """A window: every cached tile is an edge tile, and a row's first tiles may
    be wholly outside its window."""
    b = paged_batch([0, 30, 9], [37, 12, 1], 4, 2, 64, 8, device=DEVICE)
    out, ref = _run(b, new_kv=False, window=7, paged_load=paged_load)
    close(out, ref, TOL[torch.float16], TOL[torch.float16])


def test_paged_load_checked(paged_batch):
    b = paged_batch([0], [8], 2, 2, 16, 16, device=DEVICE)
    with pytest.raises(ValueError, match="paged_load"):
        _run(b, paged_load="scatter")


@pytest.mark.parametrize("new_kv,use_tma", [(True, True), (True, False), (False, None)])
def test_sliding_window(paged_batch, close, new_kv, use_tma):
    b = paged_batch([0, 30, 9], [37, 12, 1], 4, 2, 64, 16, device=DEVICE)
    out, ref = _run(b, new_kv=new_kv, window=7, use_tma=use_tma)
    close(out, ref, TOL[torch.float16], TOL[torch.float16])


def test_non_causal(paged_batch, close):
    b = paged_batch(CONTEXTS, QUERIES, 4, 2, 64, 16, device=DEVICE)
    out, ref = _run(b, causal=False)
    close(out, ref, TOL[torch.float16], TOL[torch.float16])


@pytest.mark.parametrize("head_dim,dtype", [(128, torch.float16), (80, torch.float32)])
def test_head_dims(paged_batch, close, head_dim, dtype):
    b = paged_batch([0, 19], [23, 9], 2, 1, head_dim, 16, dtype=dtype, device=DEVICE)
    out, ref = _run(b, dtype=dtype)
    close(out, ref, TOL[dtype], TOL[dtype])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 dots need a GPU (interpreter limit)")
def test_bf16_on_gpu(paged_batch, close):
    b = paged_batch(CONTEXTS, QUERIES, 8, 2, 128, 16, dtype=torch.bfloat16, device=DEVICE)
    out, ref = _run(b, dtype=torch.bfloat16)
    close(out, ref, TOL[torch.bfloat16], TOL[torch.bfloat16])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="TMA stores need a GPU")
@pytest.mark.parametrize("config", [
    {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 2, "TMA_STORE": True},
    {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2, "TMA_STORE": True, "maxnreg": 128},
])
def test_tma_store_full_and_partial_blocks(paged_batch, close, config):
    """Full query blocks leave by a bulk tensor store, the rest by masked stores;
    neither may write into a neighbour request's rows."""
    b = paged_batch([0, 0, 5, 0], [1, 17, 40, 70], 4, 2, 64, 16, device=DEVICE)
    out, ref = _run(b, config=config)
    close(out, ref, TOL[torch.float16], TOL[torch.float16])


@pytest.mark.parametrize("queries", [[1, 17, 40, 5], [64, 3, 33, 50]])  # 3 and 4 query blocks
def test_paired_query_blocks(paged_batch, close, queries):
    """PAIRED programs own query blocks last - p and p: every block written once,
    the middle one of an odd count too, and short requests' missing blocks skipped."""
    b = paged_batch(CONTEXTS, queries, 4, 2, 64, 16, device=DEVICE)
    out, ref = _run(b, config={"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 2,
                               "PAIRED": True})
    close(out, ref, TOL[torch.float16], TOL[torch.float16])


def test_explicit_config_checked(paged_batch):
    b = paged_batch([0], [8], 2, 2, 16, 16, device=DEVICE)
    with pytest.raises(ValueError, match="multiple of BLOCK_N"):
        _run(b, config={"BLOCK_M": 16, "BLOCK_N": 32})


@pytest.mark.parametrize("paged_load,page_size", [("prefetch", 8), ("prefetch32_lean", 8),
                                                   ("prefetch32", 32), ("tma_lean", 32)])
def test_paged_load_modes_quantized_cache(paged_batch, close, paged_load, page_size):
    """int8 codes with NaN scales in unwritten slots: scales follow the same
    block-table entries as the codes (TMA falls back: no TMA over codes)."""
    b = paged_batch([0, 21, 3], [17, 40, 5], 4, 2, 64, page_size, device=DEVICE)
    kc, ks, vc, vs = quantized_cache(b, "int8")
    out = torch.full(b.q.shape, float("nan"), dtype=b.q.dtype, device=DEVICE)
    prefill_attention(b.q, None, None, kc, vc, b.cu_seqlens_q, b.context_lens, b.block_tables,
                      b.max_query_len, 0.125, out=out, k_cache_scale=ks, v_cache_scale=vs,
                      use_tma=True, paged_load=paged_load)
    ref = reference.prefill_attention(b.q.float(), None, None, kc, vc, b.cu_seqlens_q, b.context_lens,
                                      b.block_tables, 0.125, k_cache_scale=ks, v_cache_scale=vs)
    close(out, ref, 4e-3, 4e-3)

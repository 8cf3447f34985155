"""The Triton backend against the reference (`reference.store_kv` then
`reference.paged_attention`, what the torch backend computes) on whole steps: a
mixed step (prompt chunks with and without cached context, plus decode tokens),
a decode-only step, and a tree-verification step. Both start from the same
cache, NaN in every unwritten slot; outputs (fp16, 4e-3) and the written caches
(exact) must agree. With an int8 / fp8 cache (codes + scales), decode-only and
tree steps read everything from the cache in both, so they must agree as well.
"""
from types import SimpleNamespace

import pytest
import torch

from slipstream.attention.triton_backend import TritonAttentionBackend
from slipstream.kernels import reference
from slipstream.batch import ForwardBatch
from tests.kernels.conftest import quantized_cache

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _step(b, tree_mask=None):
    q_lens = (b.cu_seqlens_q[1:] - b.cu_seqlens_q[:-1]).tolist()
    n = b.q.shape[0]
    return ForwardBatch(
        input_ids=torch.zeros(n, dtype=torch.long, device=DEVICE),
        positions=torch.zeros(n, dtype=torch.long, device=DEVICE),
        query_start_loc=b.cu_seqlens_q, seq_lens=b.seq_lens, context_lens=b.context_lens,
        slot_mapping=b.slot_mapping, block_tables=b.block_tables,
        logits_indices=torch.zeros(0, dtype=torch.long, device=DEVICE),
        max_query_len=max(q_lens), max_seq_len=int(b.seq_lens.max()),
        query_lens_cpu=q_lens, seq_lens_cpu=b.seq_lens.tolist(), tree_mask=tree_mask)


def _compare(b, close, window=None, tree_mask=None, kv=None):
    num_heads, num_kv_heads, head_dim = b.q.shape[1], b.k.shape[1], b.q.shape[2]
    caches = [b.k_cache, None, b.v_cache, None] if kv is None else quantized_cache(b, kv)
    fresh = lambda x: None if x is None else x.clone()  # noqa: E731
    layer = SimpleNamespace(layer_idx=0, num_heads=num_heads, num_kv_heads=num_kv_heads,
                            head_dim=head_dim, scale=head_dim ** -0.5, sliding_window=window,
                            k_cache=caches[0].clone(), v_cache=caches[2].clone(),
                            k_scale=fresh(caches[1]), v_scale=fresh(caches[3]))
    batch = _step(b, tree_mask)
    backend = TritonAttentionBackend()
    backend.prepare(batch)
    out = backend.forward(b.q, b.k, b.v, layer, batch)

    k_ref, ks_ref, v_ref, vs_ref = (fresh(x) for x in caches)
    reference.store_kv(b.k, b.v, k_ref, v_ref, b.slot_mapping, ks_ref, vs_ref)
    ref = reference.paged_attention(b.q.float(), k_ref if kv else k_ref.float(),
                                    v_ref if kv else v_ref.float(),
                                    b.cu_seqlens_q.tolist(), b.seq_lens.tolist(), b.block_tables,
                                    layer.scale, window, tree_mask, ks_ref, vs_ref)
    close(out, ref, 4e-3, 4e-3)
    for got, want in ((layer.k_cache, k_ref), (layer.v_cache, v_ref), (layer.k_scale, ks_ref),
                      (layer.v_scale, vs_ref)):
        if want is not None:
            torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=1e-6, equal_nan=True)


@pytest.mark.parametrize("window", [None, 11])
def test_mixed_prefill_and_decode_step(paged_batch, close, window, monkeypatch):
    """The Triton kernels: NaN in every unwritten slot must never reach the output."""
    from slipstream.attention import triton_backend as tb
    monkeypatch.setattr(tb, "gluon_prefill_wanted", lambda device: False)
    b = paged_batch([0, 24, 50, 7], [19, 9, 1, 1], 8, 2, 64, 16, device=DEVICE, store_new=False)
    _compare(b, close, window)


@pytest.mark.skipif(DEVICE != "cuda" or torch.cuda.get_device_capability() != (9, 0),
                    reason="the Gluon prefill kernels: sm_90")
def test_mixed_step_with_gluon_prefill(paged_batch, close):
    """The Gluon kernels (the sm_90 default for prompt rows) copy whole pages, so the
    slots past a request's keys in its last page are read and masked: they must be
    finite, as the engine's zeroed pool keeps them (kernels/gluon_prefill.py)."""
    b = paged_batch([0, 24, 50, 7], [19, 9, 1, 1], 8, 2, 64, 16, device=DEVICE, store_new=False)
    b.k_cache.nan_to_num_(0.0)
    b.v_cache.nan_to_num_(0.0)
    _compare(b, close)


@pytest.mark.parametrize("kv", [None, "int8", "fp8"])
def test_decode_only_step(paged_batch, close, kv):
    b = paged_batch([0, 24, 600], [1, 1, 1], 8, 2, 64, 16, device=DEVICE, store_new=False)
    _compare(b, close, kv=kv)


@pytest.mark.parametrize("kv", [None, "int8"])
def test_tree_step(paged_batch, close, kv):
    b = paged_batch([12, 40], [3, 2], 4, 1, 64, 16, device=DEVICE, store_new=False)
    mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # root + 2 children
    tree = torch.zeros(2, 3, 3, dtype=torch.bool)
    tree[0] = mask
    tree[1, :2, :2] = mask[:2, :2]
    _compare(b, close, tree_mask=tree.to(DEVICE), kv=kv)

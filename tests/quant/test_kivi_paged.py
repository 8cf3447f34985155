"""KIVI's paged blocks in the engine's layout (cache/kivi_paged.py) hand back what
the format's reference (quant/kivi.py) computes."""
import pytest
import torch

from slipstream.cache.kivi_paged import PagedKIVI
from slipstream.quant.kivi import kivi_fake_quantize


@pytest.mark.parametrize("bits", [4, 2])
def test_paged_blocks_read_back_the_reference(bits):
    """Two sequences written in chunks of different sizes over interleaved blocks."""
    g = torch.Generator().manual_seed(0)
    bs, h, d = 16, 2, 64
    store = PagedKIVI(12, bs, h, d, bits, torch.float32, "cpu")
    tables = [torch.tensor([3, 7, 1, 9]), torch.tensor([0, 5, 11, 2])]
    seqs = [torch.randn(53, h, d, generator=g) * 3 for _ in range(2)]
    vals = [torch.randn(53, h, d, generator=g) for _ in range(2)]
    done = [0, 0]
    for chunk in (5, 1, 17, 16, 1, 13):
        for s in range(2):
            n = min(chunk + s, 53 - done[s])
            pos = torch.arange(done[s], done[s] + n)
            slots = tables[s][pos // bs] * bs + pos % bs
            store.store(seqs[s][done[s]:done[s] + n], vals[s][done[s]:done[s] + n], slots)
            done[s] += n
            store.seal(tables[s], done[s])
            k, v = store.read(tables[s], done[s])
            rk, rv = kivi_fake_quantize(seqs[s][:done[s]], vals[s][:done[s]], bits, group=bs,
                                        residual=32)
            torch.testing.assert_close(k, rk, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(v, rv, atol=1e-5, rtol=1e-5)
    # 53 tokens: 3 full blocks, the last 2 of them (32 tokens) and the partial one exact
    assert store.residual == 2 and len(store.window) == 2 * 3
    store.finish(tables[0].tolist())            # full window blocks sealed, the partial dropped
    assert len(store.window) == 3 and int(tables[0][3]) not in store.window
    k, _ = store.read(tables[0], 48)
    rk, _ = kivi_fake_quantize(seqs[0][:48], vals[0][:48], bits, group=bs)
    torch.testing.assert_close(k, rk, atol=1e-5, rtol=1e-5)


def test_the_torch_backend_attends_over_the_kivi_blocks():
    """Steps (a prompt chunk beside a decode, then decodes) through the torch
    backend's KIVI path against attention over the reference's K/V of each
    request's cached context as it stands after the step, and the step's own
    tokens exact."""
    import torch.nn.functional as F
    from types import SimpleNamespace
    from slipstream.attention.torch_backend import TorchAttentionBackend
    from slipstream.kernels.reference import attention_mask
    from tests.models.batch_builder import BlockAllocator, Sequence, make_batch
    g = torch.Generator().manual_seed(3)
    bs, hq, h, d = 16, 4, 2, 32
    store = PagedKIVI(16, bs, h, d, 4, torch.float32, "cpu")
    layer = SimpleNamespace(kivi=store, k_scale=None, num_heads=hq, num_kv_heads=h,
                            scale=d ** -0.5, sliding_window=None)
    alloc = BlockAllocator(16)
    seqs = [Sequence(list(range(60)), bs, alloc), Sequence(list(range(60)), bs, alloc)]
    ks = [torch.randn(60, h, d, generator=g) * 2 for _ in seqs]
    vs = [torch.randn(60, h, d, generator=g) for _ in seqs]
    backend = TorchAttentionBackend()
    for steps in ([(0, 37), (1, 18)], [(0, 1), (1, 1)], [(1, 20), (0, 1)], [(0, 1), (1, 1)]):
        before = [s.num_computed for s in seqs]
        batch = make_batch([(seqs[i], n) for i, n in steps])
        q = torch.randn(batch.num_tokens, hq, d, generator=g)
        k = torch.cat([ks[i][before[i]:before[i] + n] for i, n in steps])
        v = torch.cat([vs[i][before[i]:before[i] + n] for i, n in steps])
        backend.prepare(batch)
        out = backend.forward(q, k, v, layer, batch)
        at = 0
        for i, n in steps:
            length = before[i] + n
            rk, rv = kivi_fake_quantize(ks[i][:length], vs[i][:length], 4, group=bs, residual=32)
            rk, rv = rk.clone(), rv.clone()
            rk[before[i]:], rv[before[i]:] = ks[i][before[i]:length], vs[i][before[i]:length]
            mask = attention_mask(n, length, q.device, None, None)
            ref = F.scaled_dot_product_attention(
                q[at:at + n].transpose(0, 1), rk.transpose(0, 1), rv.transpose(0, 1),
                attn_mask=mask, scale=layer.scale, enable_gqa=True).transpose(0, 1)
            torch.testing.assert_close(out[at:at + n], ref, atol=1e-5, rtol=1e-5)
            at += n

"""KIVI decode kernel (kernels/kivi_decode.py) against its twin over `PagedKIVI.read`.

Requests whose pages are partly sealed (codes) and partly in the window, pages
sealed and then handed out again (stale codes under a window page), GQA, splits,
2 and 4 bits. Tolerances: fp32 2e-5 (full-precision dots), fp16 4e-3, bf16 3e-2 (GPU).
"""
import pytest
import torch

from slipstream.cache.kivi_paged import PagedKIVI
from slipstream.kernels.kivi_decode import kivi_decode_attention, kivi_decode_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _cache(bits, lengths, kv_heads, d, page, dtype, seed=0, device=DEVICE):
    """A PagedKIVI holding requests of `lengths` tokens (written in a prompt chunk
    and then token by token, sealed as the engine seals), the block tables, and a
    freed-and-reused block: request 0's pages are sealed, then given back and one of
    them handed to the last request, whose window now covers stale codes."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // page) for n in lengths]
    store = PagedKIVI(sum(need) + 4, page, kv_heads, d, bits, dtype, device, window_slots=2)
    perm = torch.randperm(sum(need) + 4, generator=g).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(torch.tensor(perm[at:at + n], dtype=torch.int32))
        at += n
    for table, n in zip(tables, lengths):
        k = (torch.randn(n, kv_heads, d, generator=g) * 2).to(dtype)
        v = torch.randn(n, kv_heads, d, generator=g).to(dtype)
        pos = torch.arange(n)
        slots = (table.long()[pos // page] * page + pos % page).to(device)
        first = max(1, n - 5)
        store.store(k[:first].to(device), v[:first].to(device), slots[:first])
        store.seal(table, first)
        for t in range(first, n):
            store.store(k[t:t + 1].to(device), v[t:t + 1].to(device), slots[t:t + 1])
            store.seal(table, t + 1)
    return store, tables


def _run(store, tables, lengths, heads, dtype, splits, config=None, seed=1):
    g = torch.Generator().manual_seed(seed)
    d = store.k_scale.shape[-1]
    width = max(len(t) for t in tables)
    bt = torch.zeros(len(tables), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = t
    bt = bt.to(DEVICE)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(lengths), heads, d, generator=g).to(dtype).to(DEVICE)
    out = torch.full_like(q, float("nan"))
    kivi_decode_attention(q, store, seq_lens, bt, d ** -0.5, max_seq_len=max(lengths),
                          num_splits=splits, out=out, config=config)
    ref = kivi_decode_reference(q, store, seq_lens, bt, d ** -0.5)
    torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])
    return store


@pytest.mark.parametrize("bits,group,splits,page,pages", [
    (4, 1, 1, 16, None),   # MHA, one split, 64-key tiles (4 pages)
    (2, 4, 3, 16, None),   # GQA 4, three splits merged
    (4, 8, 2, 16, 1),      # GQA 8, one page a tile
    (2, 2, 2, 32, 2),      # 32-token pages, two a tile
])
def test_kivi_decode_matches_the_reference(bits, group, splits, page, pages):
    lengths = [1, 37, 90, 130]
    store, tables = _cache(bits, lengths, 2, 32, page, torch.float32)
    sealed = sum(1 for t, n in zip(tables, lengths) for b in t[:store.sealed_blocks(n)].tolist()
                 if b not in store.window)
    assert sealed >= 4 and store.window and store.win_k.shape[0] > 2   # both kinds; the pool grew
    _run(store, tables, lengths, 2 * group, torch.float32, splits,
         None if pages is None else {"PAGES": pages})


def test_kivi_decode_over_a_reused_block_reads_its_window():
    """A sealed block freed and handed out again is read from its window slot, not
    from the stale codes it still has."""
    lengths = [80, 20]
    store, tables = _cache(4, lengths, 2, 32, 16, torch.float32, seed=3)
    old = tables[0]
    store.finish(old.tolist())                                  # request 0 leaves
    reused = int(old[0])
    assert reused not in store.window and int(store.win_of[reused]) == -1
    g = torch.Generator().manual_seed(5)
    tables = [torch.tensor([reused, int(old[1])], dtype=torch.int32), tables[1]]
    k = torch.randn(20, 2, 32, generator=g)
    slots = torch.cat([reused * 16 + torch.arange(16), int(old[1]) * 16 + torch.arange(4)])
    store.store(k.to(DEVICE), (k * 0.5).to(DEVICE), slots.to(DEVICE))
    assert int(store.win_of[reused]) >= 0
    _run(store, tables, [20, 20], 4, torch.float32, 1)
    kk, _ = store.read(tables[0], 20)
    torch.testing.assert_close(kk.cpu(), k)


@pytest.mark.parametrize("dtype", [
    torch.float16,
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
        DEVICE == "cpu", reason="bf16 dots: GPU only (the interpreter mishandles them)"))])
def test_kivi_decode_half_precision(dtype):
    lengths = [50, 129]
    store, tables = _cache(4, lengths, 2, 64, 16, dtype, seed=2)
    _run(store, tables, lengths, 8, dtype, 2)


@pytest.mark.parametrize("bits,group,page", [(4, 4, 16), (2, 1, 32)])
def test_cpu_decode_attention_over_kivi(bits, group, page):
    """The C decode attention (kernels/cpu_attention.py) over a KIVI cache: sealed
    blocks dequantized as read, window blocks in place, the step's new rows stored
    into the window pool in the same call; against the twin over `PagedKIVI.read`."""
    from slipstream.kernels import cpu_attention
    if not cpu_attention.supported(torch.zeros(1), 32):
        pytest.skip("the CPU kernels are not built here")
    lengths = [40, 97, 131]
    store, tables = _cache(bits, lengths, 2, 32, page, torch.float32, device="cpu")
    g = torch.Generator().manual_seed(7)
    width = max(len(t) for t in tables)
    bt = torch.zeros(len(tables), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = t
    # one more token a request: the new rows go to the window pool in the call
    new_lens = [n + 1 for n in lengths]
    for i, n in enumerate(lengths):
        if -(-new_lens[i] // page) > len(tables[i]):
            pytest.skip("no room for the new token in the table")
    slots = torch.tensor([int(bt[i, n // page]) * page + n % page for i, n in enumerate(lengths)])
    k = torch.randn(3, 2, 32, generator=g)
    v = torch.randn(3, 2, 32, generator=g)
    pool = torch.from_numpy(store.reserve(slots))
    q = torch.randn(3, 2 * group, 32, generator=g)
    seq_lens = torch.tensor(new_lens, dtype=torch.int32)
    out = cpu_attention.decode_attention(q, store.win_k, store.win_v, seq_lens, bt, 32 ** -0.5,
                                         None, k, v, pool, kivi=cpu_attention.kivi_struct(store))
    sealed = sum(store.sealed_blocks(n) for n in new_lens)
    assert sealed >= 4
    ref = kivi_decode_reference(q, store, seq_lens, bt, 32 ** -0.5)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    kk, vv = store.read(bt[2], new_lens[2])
    torch.testing.assert_close(kk[-1], k[2])
    torch.testing.assert_close(vv[-1], v[2])

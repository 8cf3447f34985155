"""Decode attention over a KIVI cache (cache/kivi_paged.py), split over the keys.

One query token a request; program (request, KV head, split) streams its share
of the request's pages, PAGES of them a tile. Each page is either sealed (2- or
4-bit codes) or still in the full-precision window, which `win_of[block]` says
(its window slot, or -1). A tile always loads the codes (masked off for window
pages); only a tile holding a window page (the newest few of a request) also
loads the window's rows and keeps, per key, the kind that holds it:

    sealed key  k[t, c] = code(t, c) * k_scale[page, c] + k_zero[page, c]
                (codes per channel, packed along the page's tokens),
    sealed value v[t, c] = code(t, c) * v_scale[page, t, c // CG] + v_zero[...]
                (codes per token, packed along channels, a scale a channel group),
    window key / value: the slot's row as stored.

The next tile's block ids and window slots are read while this tile computes.
Dequantized K/V go to the tensor cores in the query's dtype (fp32 queries:
fp32 operands, exact products). GQA: the query tile holds all query heads of one
KV group, padded to 16 rows. With more than one split the partial results are
merged by split_merge.py. The plain-PyTorch twin is `kivi_decode_reference`;
the engine's reference path is the torch backend over `PagedKIVI.read`.

Bytes a key and KV head at head_dim 128, 4 bits: 64 + 64 of codes, 2 x 2 x 4 of
value scales and zeros, 2 x 2 x 128 / block_size of key scales and zeros: about
a quarter of bf16's 512. Measured on the H200 (benchmarks/quant/README.md) it is
small, not fast: 0.40-0.65x the bf16 cache's split-KV kernel with 16- or 32-token
pages, bound by the dequantization's instructions and latency (each program's
time falls with the split count, so the splits fill about four programs an SM),
not by bytes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from slipstream.kernels.attention_tile import LOG2E, next_pow2
from slipstream.kernels.runtime import interpreting, num_sms
from slipstream.kernels.split_merge import merge_splits, split_kv_scratch



@triton.jit
def _unpack(b, BITS: tl.constexpr):
    """uint8 [..., n] -> codes (int32) [..., n * 8 // BITS], element j of byte i at
    position i * (8 // BITS) + j (the packing of quant/primitives.py)."""
    x = b.to(tl.int32)
    if BITS == 4:
        return tl.interleave(x & 15, x >> 4)
    else:
        return tl.interleave(tl.interleave(x & 3, (x >> 4) & 3),
                             tl.interleave((x >> 2) & 3, x >> 6))


@triton.jit(do_not_specialize=["num_kv_heads", "num_splits", "qk_scale"])
def _kivi_decode_kernel(
        Q, KCodes, KScale, KZero, VCodes, VScale, VZero, WinK, WinV, WinOf,
        Out, PartO, PartLse, SeqLens, BlockTables,
        num_kv_heads, num_splits,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kc0, stride_kc1, stride_kc2, stride_ks0, stride_ks1,
        stride_vc0, stride_vc1, stride_vc2, stride_vs0, stride_vs1, stride_vs2,
        stride_w0, stride_w1, stride_w2, stride_bt,
        stride_pt, stride_ph, stride_ps, stride_lt, stride_lh,
        qk_scale,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
        PAGE: tl.constexpr, PAGES: tl.constexpr, BITS: tl.constexpr, CG: tl.constexpr,
        SPLIT: tl.constexpr, IEEE: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + seq)
    BLOCK_N: tl.constexpr = PAGE * PAGES
    PER: tl.constexpr = 8 // BITS
    NG: tl.constexpr = HEAD_DIM // CG
    PREC: tl.constexpr = "ieee" if IEEE else "tf32"
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    per_split = tl.cdiv(num_tiles, num_splits)
    start = split * per_split
    end = tl.minimum(start + per_split, num_tiles)

    rows = tl.arange(0, BLOCK_M)
    head = kv_head * GROUP + rows
    row_ok = rows < GROUP
    offs_d = tl.arange(0, HEAD_DIM)
    tok = seq.to(tl.int64)
    q = tl.load(Q + tok * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    n = tl.arange(0, BLOCK_N)
    off = n % PAGE
    offs_p = tl.arange(0, PAGES)
    offs_t = tl.arange(0, PAGE)
    kb = tl.arange(0, PAGE // PER)           # a key channel's code bytes in a page
    vb = tl.arange(0, HEAD_DIM // PER)       # a value token's code bytes
    offs_g = tl.arange(0, NG)
    bt_row = BlockTables + tok * stride_bt

    # The pages of the first tile; each iteration fetches the next tile's ahead.
    page_pos = start * PAGES + offs_p
    page_ok = (page_pos * PAGE < seq_len) & (start < end)
    blk = tl.load(bt_row + page_pos, mask=page_ok, other=0).to(tl.int64)
    win = tl.load(WinOf + blk, mask=page_ok, other=-1).to(tl.int64)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for tile in range(start, end):
        coded = page_ok & (win < 0)
        pos = tile * BLOCK_N + n
        ok = pos < seq_len
        # Keys, transposed: a page's codes are [channel, token / PER] bytes.
        kc_base = blk * stride_kc0 + kv_head * stride_kc1
        k_bytes = tl.load(KCodes + kc_base[:, None, None] + offs_d[None, :, None] * stride_kc2
                          + kb[None, None, :], mask=coded[:, None, None], other=0)
        ks_base = (blk * stride_ks0 + kv_head * stride_ks1)[:, None] + offs_d[None, :]
        k_s = tl.load(KScale + ks_base, mask=coded[:, None], other=0.0).to(tl.float32)
        k_z = tl.load(KZero + ks_base, mask=coded[:, None], other=0.0).to(tl.float32)
        kt = _unpack(k_bytes, BITS).to(tl.float32) * k_s[:, :, None] + k_z[:, :, None]
        kt = tl.reshape(tl.permute(kt, (1, 0, 2)), (HEAD_DIM, BLOCK_N))      # [D, N]
        # Values: a token's codes are [channel / PER] bytes, a scale a channel group.
        vc_base = blk * stride_vc0 + kv_head * stride_vc2
        v_bytes = tl.load(VCodes + vc_base[:, None, None] + offs_t[None, :, None] * stride_vc1
                          + vb[None, None, :], mask=coded[:, None, None], other=0)
        vs_base = ((blk * stride_vs0 + kv_head * stride_vs2)[:, None, None]
                   + offs_t[None, :, None] * stride_vs1 + offs_g[None, None, :])
        v_s = tl.load(VScale + vs_base, mask=coded[:, None, None], other=0.0).to(tl.float32)
        v_z = tl.load(VZero + vs_base, mask=coded[:, None, None], other=0.0).to(tl.float32)
        v_c = tl.reshape(_unpack(v_bytes, BITS), (PAGES, PAGE, NG, CG)).to(tl.float32)
        v = tl.reshape(v_c * v_s[:, :, :, None] + v_z[:, :, :, None], (BLOCK_N, HEAD_DIM))
        kt = kt.to(q.dtype)
        v = v.to(q.dtype)
        if tl.max(win) >= 0:   # a page of the window in this tile (the newest few)
            w_page = tl.reshape(tl.broadcast_to(win[:, None], (PAGES, PAGE)), (BLOCK_N,))
            in_win = ok & (w_page >= 0)
            w_off = w_page * stride_w0 + off * stride_w1 + kv_head * stride_w2
            kw = tl.load(WinK + w_off[:, None] + offs_d[None, :], mask=in_win[:, None], other=0.0)
            vw = tl.load(WinV + w_off[:, None] + offs_d[None, :], mask=in_win[:, None], other=0.0)
            kt = tl.where(in_win[None, :], tl.trans(kw).to(q.dtype), kt)
            v = tl.where(in_win[:, None], vw.to(q.dtype), v)
        # the next tile's pages, while this one computes
        page_pos = (tile + 1) * PAGES + offs_p
        page_ok = (page_pos * PAGE < seq_len) & (tile + 1 < end)
        blk = tl.load(bt_row + page_pos, mask=page_ok, other=0).to(tl.int64)
        win = tl.load(WinOf + blk, mask=page_ok, other=-1).to(tl.int64)

        s = tl.dot(q, kt, input_precision=PREC)
        s = tl.where(ok[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PREC)
        m_i = m_new

    if not SPLIT:
        out = acc / l_i[:, None]
        tl.store(Out + tok * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(Out.dtype.element_ty), mask=row_ok[:, None])
    else:
        # An empty split (short request) leaves l = 0: weight 0 in the merge.
        seen = l_i > 0
        l_safe = tl.where(seen, l_i, 1.0)
        lse = tl.where(seen, m_i + tl.math.log2(l_safe), float("-inf"))
        tl.store(PartO + tok * stride_pt + head[:, None] * stride_ph + split * stride_ps
                 + offs_d[None, :], acc / l_safe[:, None], mask=row_ok[:, None])
        tl.store(PartLse + tok * stride_lt + head * stride_lh + split, lse, mask=row_ok)


def supported(store, q: torch.Tensor) -> bool:
    """Whether the kernel serves this cache and query (else the torch path)."""
    d = store.k_scale.shape[-1]
    return (q.is_cuda or interpreting()) and d == next_pow2(d) and d >= 16 \
        and store.block_size == next_pow2(store.block_size)


def kivi_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, tile: int,
                    sm_count: int | None = None) -> int:
    """About four programs an SM (measured on the H200: time falls nearly as 1 / splits
    up to there), at least one tile a split, at most 64 splits."""
    if sm_count is None:   # (the interpreter: a few programs, quick tests)
        sm_count = 2 if interpreting() or not torch.cuda.is_available() else num_sms()
    want = 4 * sm_count // max(num_seqs * num_kv_heads, 1)
    return max(1, min(want, -(-max_seq_len // tile), 64))


def kivi_decode_attention(q: torch.Tensor, store, seq_lens: torch.Tensor,
                          block_tables: torch.Tensor, scale: float, *, max_seq_len: int,
                          num_splits: int | None = None, out: torch.Tensor | None = None,
                          config: dict | None = None) -> torch.Tensor:
    """q: [num_seqs, num_heads, head_dim], one token a request whose K/V are already
    stored in `store` (a PagedKIVI). seq_lens: [num_seqs] int32 (its token included);
    block_tables: [num_seqs, max_blocks] int32; max_seq_len: host bound of seq_lens.
    config: PAGES (pages a tile), num_warps, num_stages. Returns [num_seqs, num_heads,
    head_dim] in q's dtype."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = store.k_scale.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if head_dim != next_pow2(head_dim):
        raise ValueError(f"kivi_decode_attention: head_dim {head_dim} must be a power of two")
    assert q.stride(2) == 1 and store.win_k.stride(3) == 1
    group = num_heads // num_kv_heads
    page = store.block_size
    cfg = dict(config or {})
    # 32-key tiles in 2 warps: the best of the H200 sweep at 4k-128k, B=1 and B=32
    pages = cfg.pop("PAGES", max(1, 32 // page))
    if num_splits is None:
        num_splits = kivi_num_splits(num_seqs, num_kv_heads, max_seq_len, page * pages)
    if out is None:
        out = torch.empty_like(q)
    if num_splits > 1:
        part_o, part_lse = split_kv_scratch(num_seqs, num_heads, num_splits, head_dim, q.device)
        po, pl = part_o.stride()[:3], part_lse.stride()[:2]
    else:
        part_o = part_lse = out
        po, pl = (0, 0, 0), (0, 0)
    if interpreting():
        cfg = {"num_warps": 1, "num_stages": 1, **cfg}
    else:
        cfg = {"num_warps": 2, "num_stages": 2, **cfg}
    kc, ks, vc, vs, w = store.k_codes, store.k_scale, store.v_codes, store.v_scale, store.win_k
    _kivi_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, kc, ks, store.k_zero, vc, vs, store.v_zero, w, store.win_v, store.win_of,
        out, part_o, part_lse, seq_lens, block_tables, num_kv_heads, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2), ks.stride(0), ks.stride(1),
        vc.stride(0), vc.stride(1), vc.stride(2), vs.stride(0), vs.stride(1), vs.stride(2),
        w.stride(0), w.stride(1), w.stride(2), block_tables.stride(0),
        *po, *pl, scale * LOG2E,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_M=max(16, next_pow2(group)), PAGE=page,
        PAGES=pages, BITS=store.bits, CG=store.channel_group, SPLIT=num_splits > 1,
        IEEE=q.dtype == torch.float32, **cfg)
    if num_splits > 1:
        merge_splits(part_o, part_lse, out, num_splits, head_dim, head_dim, False)
    return out


def kivi_decode_reference(q: torch.Tensor, store, seq_lens, block_tables, scale: float
                          ) -> torch.Tensor:
    """The twin: each request's keys and values as `store.read` gives them, fp32 attention."""
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    rep = q.shape[1] // store.k_scale.shape[1]
    for i, n in enumerate(seq_lens.tolist()):
        k, v = store.read(block_tables[i], n)
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        s = torch.einsum("hd,thd->ht", q[i].float(), k) * scale
        out[i] = torch.einsum("ht,thd->hd", s.softmax(-1), v)
    return out

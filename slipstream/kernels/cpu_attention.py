"""Decode attention on the CPU over the paged KV cache (launcher for `cpu_quant.c`).

One new token per sequence; each (sequence, head) walks its block table and
reads K/V rows in place with an online softmax, so no step gathers the whole
context into a new tensor. The step's new K/V can be written to the cache in
the same call (`k`, `v`, `slot_mapping`), which saves the half-dozen indexing
ops of a torch store per layer. Twin: `cpu_reference.decode_attention`.

Over a KIVI cache (`kivi`: a `PagedKIVI`, cache/kivi_paged.py) the caches are its
window pool and the slots window-pool slots; a sealed block's rows are
dequantized from its codes as they are read (twin: the torch backend's KIVI path).
"""
from __future__ import annotations

import ctypes

import torch

from slipstream.kernels import cpu_library

KV_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def supported(k_cache: torch.Tensor, head_dim: int) -> bool:
    return (cpu_library.load() is not None and k_cache.device.type == "cpu"
            and k_cache.dtype in KV_DTYPES and head_dim <= 512)


class KIVIStruct(ctypes.Structure):
    """A KIVI cache as the C code reads it (ss_kivi_t in cpu_quant.c)."""
    _fields_ = [("k_codes", ctypes.c_void_p), ("k_scale", ctypes.c_void_p), ("k_zero", ctypes.c_void_p),
                ("v_codes", ctypes.c_void_p), ("v_scale", ctypes.c_void_p), ("v_zero", ctypes.c_void_p),
                ("win_of", ctypes.c_void_p), ("bits", ctypes.c_int32), ("cg", ctypes.c_int32)]


def kivi_struct(store) -> KIVIStruct:
    """The C description of a PagedKIVI's codes (its tensors must outlive the calls)."""
    ts = (store.k_codes, store.k_scale, store.k_zero, store.v_codes, store.v_scale, store.v_zero,
          store.win_of)
    assert all(t.device.type == "cpu" and t.is_contiguous() for t in ts)
    return KIVIStruct(*(t.data_ptr() for t in ts), store.bits, store.channel_group)


def _rows(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """fp32, heads-by-dim contiguous within each token; -> (tensor, token stride)."""
    if t.dtype != torch.float32 or t.stride(-1) != 1 or t.stride(-2) != t.shape[-1]:
        t = t.float().contiguous()
    return t, t.stride(0)


class _NewKV:
    """The step's own K/V rows to store before attending (k, v: [tokens, kv_heads, head_dim],
    slot_mapping: [tokens]), or none; holds the converted tensors while the C call runs."""

    def __init__(self, k, v, slot_mapping):
        self.k = self.v = self.slots = None
        if k is not None:
            (self.k, self.k_stride), (self.v, self.v_stride) = _rows(k), _rows(v)
            self.slots = slot_mapping.to(torch.int64).contiguous()

    def args(self) -> tuple:
        """(k, k_stride, v, v_stride, slots) as the C functions take them."""
        if self.k is None:
            return None, 0, None, 0, None
        return (self.k.data_ptr(), self.k_stride, self.v.data_ptr(), self.v_stride,
                self.slots.data_ptr())


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                     sliding_window: int | None = None, k: torch.Tensor | None = None,
                     v: torch.Tensor | None = None, slot_mapping: torch.Tensor | None = None,
                     kivi: KIVIStruct | None = None) -> torch.Tensor:
    """q: [num_seqs, num_heads, head_dim]; caches: [num_blocks, block_size, kv_heads, head_dim]
    (fp32 or bf16, contiguous); seq_lens: [num_seqs] int32, counting the new token;
    block_tables: [num_seqs, max_blocks] int32; k, v: [num_seqs, kv_heads, head_dim] and
    slot_mapping [num_seqs] int64, to store first (else already stored)
    -> [num_seqs, num_heads, head_dim] in q's dtype."""
    lib = cpu_library.load()
    b, nh, hd = q.shape
    nkv, bs = k_cache.shape[2], k_cache.shape[1]
    qf, q_stride = _rows(q)
    out = torch.empty(b, nh, hd, dtype=torch.float32)
    lens = seq_lens if seq_lens.dtype == torch.int32 else seq_lens.to(torch.int32)
    tables = block_tables if block_tables.dtype == torch.int32 else block_tables.to(torch.int32)
    lens, tables = lens.contiguous(), tables.contiguous()
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    new_kv = _NewKV(k, v, slot_mapping)
    rc = lib.ss_decode_attention(qf.data_ptr(), q_stride, k_cache.data_ptr(), v_cache.data_ptr(),
                                 KV_DTYPES[k_cache.dtype], tables.data_ptr(), tables.shape[1],
                                 lens.data_ptr(), b, nh, nkv, hd, bs, scale, sliding_window or 0,
                                 *new_kv.args(), out.data_ptr(),
                                 None if kivi is None else ctypes.byref(kivi))
    assert rc == 0, "ss_decode_attention rejected its arguments"
    return out if q.dtype == torch.float32 else out.to(q.dtype)


MAX_QUERY = 64      # tokens a sequence may bring to `tree_attention` (bits of its masks)
_CAUSAL = torch.tensor([(1 << (i + 1)) - 1 if i < 63 else -1 for i in range(MAX_QUERY)], dtype=torch.int64)
_BITS = torch.tensor([1 << i if i < 63 else -(1 << 63) for i in range(MAX_QUERY)], dtype=torch.int64)


def query_masks(query_lens: list[int], tree_mask: torch.Tensor | None) -> torch.Tensor:
    """Bit j of row t: token t sees its sequence's step token j -> [num_tokens] int64
    (uint64 bits). tree_mask: [num_seqs, >= max_q, >= max_q] bool, or None: causal."""
    if max(query_lens) > MAX_QUERY:
        raise ValueError(f"query_lens: at most {MAX_QUERY} tokens a sequence, got {max(query_lens)}")
    if tree_mask is None:
        return torch.cat([_CAUSAL[:n] for n in query_lens])
    tm = tree_mask.to("cpu", torch.int64)
    return torch.cat([(tm[i, :n, :n] * _BITS[:n]).sum(-1) for i, n in enumerate(query_lens)])


def tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   seq_lens: torch.Tensor, block_tables: torch.Tensor, query_lens: list[int],
                   scale: float, sliding_window: int | None = None,
                   tree_mask: torch.Tensor | None = None, k: torch.Tensor | None = None,
                   v: torch.Tensor | None = None, slot_mapping: torch.Tensor | None = None) -> torch.Tensor:
    """A few tokens per sequence (query_lens[s] <= 64) after its cached ones, causal
    among themselves or as `tree_mask` [num_seqs, >= max_q, >= max_q] says.
    q: [num_tokens, num_heads, head_dim]; seq_lens [num_seqs] count the step's
    tokens; k, v [num_tokens, kv_heads, head_dim] with slot_mapping: stored first
    -> [num_tokens, num_heads, head_dim] in q's dtype. Twin: reference.paged_attention."""
    lib = cpu_library.load()
    n, nh, hd = q.shape
    nkv, bs = k_cache.shape[2], k_cache.shape[1]
    if sum(query_lens) != n:
        raise ValueError(f"query_lens sum to {sum(query_lens)}, q has {n} tokens")
    qf, q_stride = _rows(q)
    out = torch.empty(n, nh, hd, dtype=torch.float32)
    lens = seq_lens.to(torch.int32).contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    qloc = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    masks = query_masks(query_lens, tree_mask)
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    new_kv = _NewKV(k, v, slot_mapping)
    rc = lib.ss_tree_attention(qf.data_ptr(), q_stride, k_cache.data_ptr(), v_cache.data_ptr(),
                               KV_DTYPES[k_cache.dtype], tables.data_ptr(), tables.shape[1], lens.data_ptr(),
                               qloc.data_ptr(), masks.data_ptr(), len(query_lens), max(query_lens),
                               nh, nkv, hd, bs, scale, sliding_window or 0,
                               *new_kv.args(), out.data_ptr())
    if rc != 0:
        raise ValueError("ss_tree_attention rejected its arguments (head_dim <= 512, "
                         "at most 32 query heads a KV head)")
    return out if q.dtype == torch.float32 else out.to(q.dtype)

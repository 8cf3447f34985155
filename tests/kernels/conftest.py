"""Random paged-KV batches for the kernel tests.

Caches start as NaN everywhere, so a kernel that reads a slot no request wrote
(past a sequence end, a padded block-table entry) poisons its output.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from slipstream.kernels import reference


@dataclass
class PagedBatch:
    q: torch.Tensor             # [num_tokens, num_heads, head_dim]
    k: torch.Tensor             # [num_tokens, num_kv_heads, head_dim], the step's keys
    v: torch.Tensor
    k_cache: torch.Tensor       # [num_blocks, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32
    context_lens: torch.Tensor  # [num_seqs] int32
    seq_lens: torch.Tensor      # [num_seqs] int32
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64
    max_query_len: int


def make_paged_batch(context_lens, query_lens, num_heads, num_kv_heads, head_dim, page_size,
                     dtype=torch.float16, device="cpu", store_new=True) -> PagedBatch:
    """Random q/k/v and a cache holding each request's context (and, with
    `store_new`, the step's tokens after it) in randomly permuted blocks."""
    seq_lens = [c + n for c, n in zip(context_lens, query_lens)]
    blocks = [-(-s // page_size) for s in seq_lens]
    num_blocks = sum(blocks) + 3
    perm = torch.randperm(num_blocks).tolist()
    max_blocks = max(max(blocks), 1)
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    used = 0
    for i, b in enumerate(blocks):
        tables[i, :b] = torch.tensor(perm[used:used + b], dtype=torch.int32)
        used += b
    shape = (num_blocks, page_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    # Context tokens go straight into their slots.
    for i, c in enumerate(context_lens):
        pos = torch.arange(c)
        slots = tables[i, pos // page_size].long() * page_size + pos % page_size
        reference.store_kv(torch.randn(c, num_kv_heads, head_dim, dtype=dtype),
                           torch.randn(c, num_kv_heads, head_dim, dtype=dtype), k_cache, v_cache, slots)
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, num_heads, head_dim, dtype=dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, dtype=dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, dtype=dtype)
    slot_list = []
    for i, (c, n) in enumerate(zip(context_lens, query_lens)):
        pos = torch.arange(c, c + n)
        slot_list.append(tables[i, pos // page_size].long() * page_size + pos % page_size)
    slot_mapping = torch.cat(slot_list) if slot_list else torch.zeros(0, dtype=torch.long)
    if store_new:
        reference.store_kv(k, v, k_cache, v_cache, slot_mapping)
    cu = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32)
    t = lambda x: x.to(device)  # noqa: E731
    return PagedBatch(t(q), t(k), t(v), t(k_cache), t(v_cache), t(cu),
                      t(torch.tensor(context_lens, dtype=torch.int32)),
                      t(torch.tensor(seq_lens, dtype=torch.int32)), t(tables), t(slot_mapping),
                      max(query_lens))


def quantized_cache(b, fmt_name):
    """The batch's caches as codes + scales (NaN scales where nothing was written)."""
    from slipstream.quant.kv_quant import KV_FORMATS
    fmt = KV_FORMATS[fmt_name]
    out = []
    for cache in (b.k_cache, b.v_cache):
        flat = cache.flatten(0, 1).float()
        written = ~flat.isnan().any(-1).any(-1)
        codes = torch.zeros(flat.shape, dtype=fmt.storage, device=cache.device)
        scale = torch.full(flat.shape[:2], float("nan"), device=cache.device)
        c, s = fmt.quantize(flat[written])
        codes[written], scale[written] = c, s
        out += [codes.view(cache.shape), scale.view(cache.shape[:3])]
    return out  # k codes, k scale, v codes, v scale


def check_quantized_tree(paged_batch, close, fmt_name, device, config=None):
    """A two-request tree step (4 and 1 query tokens, 30 and 70 cached) over a quantized
    cache, the kernel (with `config`) against the reference."""
    from slipstream.kernels import reference
    from slipstream.kernels.tree_attention import ancestor_mask, tree_attention
    b = paged_batch([30, 70], [4, 1], 8, 2, 64, 16, device=device)
    full = ancestor_mask([-1, 0, 0, 1])
    masks = torch.zeros(2, 4, 4, dtype=torch.bool)
    masks[0], masks[1, :1, :1] = full, full[:1, :1]
    masks = masks.to(device)
    kc, ks, vc, vs = quantized_cache(b, fmt_name)
    out = torch.full(b.q.shape, float("nan"), dtype=b.q.dtype, device=device)
    tree_attention(b.q, kc, vc, b.cu_seqlens_q, b.seq_lens, b.block_tables, masks, 0.125,
                   max_query_len=4, max_seq_len=int(b.seq_lens.max()), num_splits=2, out=out,
                   config=config, k_scale=ks, v_scale=vs)
    ref = reference.tree_attention(b.q.float(), kc, vc, b.cu_seqlens_q, b.seq_lens, b.block_tables,
                                   masks, 0.125, k_scale=ks, v_scale=vs)
    close(out, ref, 4e-3, 4e-3)


def check_close(out: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float) -> None:
    """Every element written (no NaN left from the poisoned output) and close."""
    assert not out.isnan().any(), "unwritten or NaN elements in the output"
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


def poisoned(like: torch.Tensor, dtype=None) -> torch.Tensor:
    return torch.full(like.shape, float("nan"), dtype=dtype or like.dtype, device=like.device)


@pytest.fixture
def paged_batch():
    return make_paged_batch


@pytest.fixture
def close():
    return check_close


@pytest.fixture
def nan_like():
    return poisoned


def compile_in_child(code: str, *args: str) -> dict:
    """Run `code` (which prints one JSON object last) in a child Python without the
    interpreter: sm_90 compiles need the real compiler, which TRITON_INTERPRET replaces."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=os.pathsep.join(
        [str(root)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    run = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def assert_ring_compiled(report: dict) -> None:
    """A TMA-ring GEMV compiled for sm_90 (gluon_compile.ring_report): the ring's copies,
    the PDL wait and trigger, no spills, shared memory within the SM's."""
    import pytest
    if "skip" in report:
        pytest.skip(report["skip"])
    assert report["tma"] >= 2 and report["wait"] and report["trigger"], report
    assert report["spills"] == 0 and report["shared"] <= 227 * 1024, report

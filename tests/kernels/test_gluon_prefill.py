"""The Gluon prefill kernel (sm_90 only).

On the CPU: every kernel variant compiles for sm_90 (a child process without the
interpreter, as in test_sm90_compile.py) and has FlashAttention-3's overlap, in
the PTX and after ptxas in the SASS: the softmax's exp2 runs while the scores'
and the previous P.V's wgmma groups were both issued, only the first waited on
(ptxas once hoisted the P.V wait above the whole softmax); bad input raises
ValueError. On an H100/H200: outputs against the plain-PyTorch twin
(reference.prefill_attention without context), bf16 and fp16.
"""
import json
import os

import pytest
import torch

from slipstream.kernels import reference
from slipstream.kernels.gluon_compile import overlap_report
from slipstream.kernels.gluon_prefill import (check_inputs, check_paged_inputs, gluon_prefill,
                                              gluon_prefill_paged, kernel_args)
from tests.kernels.conftest import compile_in_child

BASE = {"BLOCK_M": 128, "BLOCK_N": 128, "STAGES": 2, "WS": False, "PINGPONG": False, "num_warps": 8}
CONFIGS = {  # four compiles (a few seconds each): every mode's code compiles somewhere
    "default": ({}, {}),
    "ws_n64_s4_fp16_gqa_hdim64": ({"WS": True, "BLOCK_N": 64, "STAGES": 4},
                                  {"dtype": "float16", "heads": 9, "kv_heads": 3, "head_dim": 64,
                                   "causal": False}),
    "pingpong_persistent": ({"WS": True, "PINGPONG": True, "num_warps": 4, "PERSISTENT": True}, {}),
    "unpinned": ({"PIN": False}, {}),  # the control: ptxas's own placement of the P.V wait
    # Paged K/V (the engine's cache): 16-token pages, a TMA copy a page, in the
    # producer warp of the ping-pong kernel; 128-token pages copied by the consumers.
    "paged_pingpong_page16": ({"WS": True, "PINGPONG": True, "num_warps": 4}, {"paged": True}),
    "paged_page128": ({}, {"paged": True, "page": 128}),
    # three consumer warpgroups of 64 rows (BLOCK_M 192), no turns, 64-key tiles
    "three_consumers": ({"WS": True, "PINGPONG": True, "num_warps": 4, "BLOCK_M": 192, "TURNS": False,
                         "BLOCK_N": 64, "STAGES": 4}, {}),
    # the softmax's row max and sum by pairwise halving, against "pingpong" below
    "pingpong_tree": ({"WS": True, "PINGPONG": True, "num_warps": 4, "TREE": True}, {}),
    "pingpong": ({"WS": True, "PINGPONG": True, "num_warps": 4}, {}),
}
_CHILD = """
import json, sys, torch
from slipstream.kernels.gluon_compile import (chain_depth, compile_paged_prefill, compile_prefill,
                                              overlap_report, sass, sass_overlap)
out = {}
for name, (cfg, kw) in json.loads(sys.argv[1]).items():
    if "dtype" in kw:
        kw["dtype"] = getattr(torch, kw["dtype"])
    try:
        compile = compile_paged_prefill if kw.pop("paged", False) else compile_prefill
        k = compile(cfg, **kw)
        out[name] = {"shared": k.metadata.shared, "block_n": cfg.get("BLOCK_N", 128),
                     "pinned": cfg.get("PIN", True), "tree": cfg.get("TREE", False),
                     "max_depth": chain_depth(sass(k.asm["cubin"]), "FMNMX"),
                     "sum_depth": chain_depth(sass(k.asm["cubin"]), "FADD"),
                     **overlap_report(k.asm["ptx"]), "sass_exp2": sass_overlap(k.asm["cubin"])}
    except FileNotFoundError as e:  # a Triton build without its ptxas
        out[name] = {"skip": str(e)}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def compiled():
    return compile_in_child(_CHILD, json.dumps(CONFIGS))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_compiles_for_sm90_with_overlap(compiled, name):
    r = compiled[name]
    if "skip" in r:
        pytest.skip(r["skip"])
    assert r["wgmma"] >= 16 and r["tma_copies"] > 0, r
    assert r["softmax_under_two_groups"], r
    assert r["shared"] <= 227 * 1024, r
    # With the wait pinned, every exp2 of a thread's share of the tile (BLOCK_N / 2
    # scores, 2 rescale factors) runs under P.V in the SASS; without, ptxas hoists
    # the wait above them all (the check can tell the two apart).
    if r["pinned"]:
        assert r["sass_exp2"] and min(r["sass_exp2"]) >= r["block_n"] // 2, r
    else:
        assert r["sass_exp2"] and max(r["sass_exp2"]) == 0, r
    # A thread's row max and row sum over its BLOCK_N / 4 scores of a row: one value after
    # another (gl.max / gl.sum), or halved pairwise down to 2 and then across the 4 lanes.
    if r["tree"]:
        assert r["max_depth"] <= 8 and r["sum_depth"] <= 8, r
    elif name == "pingpong":
        assert r["max_depth"] >= r["block_n"] // 4 and r["sum_depth"] >= r["block_n"] // 4, r


def test_overlap_report_sees_serial_wgmma():
    """A loop that waits on each group at once (what Triton 3.6 emits) is not
    reported as overlapped."""
    body = ["wgmma.mma_async.sync.aligned.m64n128k16 {...};", "wgmma.commit_group.sync.aligned;",
            "wgmma.wait_group.sync.aligned 0;", "ex2.approx.ftz.f32 %r1, %r2;"]
    assert not overlap_report("\n".join(body * 2))["softmax_under_two_groups"]
    overlapped = body[:2] * 2 + ["wgmma.wait_group.sync.aligned 1;", "ex2.approx.f32 %r1, %r2;"]
    assert overlap_report("\n".join(overlapped))["softmax_under_two_groups"]


def _qkv(tokens=64, heads=4, kv_heads=2, dim=128, dtype=torch.bfloat16):
    return (torch.zeros(tokens, heads, dim, dtype=dtype),
            torch.zeros(tokens, kv_heads, dim, dtype=dtype),
            torch.zeros(tokens, kv_heads, dim, dtype=dtype))


@pytest.mark.parametrize("bad, match", [
    (lambda q, k, v, cu: (q[..., :32].contiguous(), k[..., :32].contiguous(),
                          v[..., :32].contiguous(), cu), "head_dim"),
    (lambda q, k, v, cu: (q.float(), k.float(), v.float(), cu), "dtype"),
    (lambda q, k, v, cu: (q[:, :3], k, v, cu), "heads"),
    (lambda q, k, v, cu: (q, k[:32], v[:32], cu), "tokens"),
    (lambda q, k, v, cu: (q.transpose(0, 1).contiguous().transpose(0, 1), k, v, cu), "strides"),
    (lambda q, k, v, cu: (q, k, v, cu.long()), "cu_seqlens"),
])
def test_rejects_unsupported_input(bad, match):
    q, k, v = _qkv()
    cu = torch.tensor([0, 64], dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        check_inputs(*bad(q, k, v, cu))


def test_needs_hopper_and_valid_config():
    q, k, v = _qkv()
    cu = torch.tensor([0, 64], dtype=torch.int32)
    with pytest.raises(ValueError, match="sm_90"):
        gluon_prefill(q, k, v, cu, 64, 0.1)  # CPU tensors
    with pytest.raises(ValueError, match="PINGPONG"):
        kernel_args(q, k, v, q, cu, 64, 0.1, True, {"PINGPONG": True})
    with pytest.raises(ValueError, match="num_warps"):
        kernel_args(q, k, v, q, cu, 64, 0.1, True, {"BLOCK_M": 64})
    with pytest.raises(ValueError, match="unknown config keys"):
        kernel_args(q, k, v, q, cu, 64, 0.1, True, {"BLOCK_K": 64})
    with pytest.raises(ValueError, match="PERSISTENT"):
        kernel_args(q, k, v, q, cu, 64, 0.1, True, {"PERSISTENT": True})
    three = {"WS": True, "PINGPONG": True, "num_warps": 4, "BLOCK_M": 192}
    with pytest.raises(ValueError, match="TURNS"):
        kernel_args(q, k, v, q, cu, 64, 0.1, True, three)
    _, consts, grid = kernel_args(q, k, v, q, cu, 300, 0.1, True, {**three, "TURNS": False})
    assert consts["BLOCK_M"] == 192 and grid[0] == 2  # blocks of 192 rows


hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                            reason="the Gluon prefill kernel needs an sm_90 GPU")


@hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("config", [BASE, {**BASE, "WS": True},
                                    {**BASE, "WS": True, "PINGPONG": True, "num_warps": 4},
                                    {**BASE, "WS": True, "PERSISTENT": True},
                                    {**BASE, "WS": True, "PINGPONG": True, "num_warps": 4,
                                     "PERSISTENT": True, "SNAKE": True, "HEAD_GROUP": 4096},
                                    {**BASE, "WS": True, "PINGPONG": True, "num_warps": 4, "TABLE": True},
                                    {**BASE, "WS": True, "PINGPONG": True, "num_warps": 4, "BLOCK_M": 192,
                                     "TURNS": False, "BLOCK_N": 64, "STAGES": 4},
                                    {**BASE, "WS": True, "PINGPONG": True, "num_warps": 4, "TREE": True},
                                    {**BASE, "TREE": True, "BLOCK_N": 64},
                                    {**BASE, "WS": True, "PINGPONG": True, "num_warps": 4, "LATE_K": True},
                                    {**BASE, "WS": True, "PINGPONG": True, "num_warps": 4, "LATE_K": True,
                                     "PERSISTENT": True, "SNAKE": True},
                                    None])  # None: what the backend runs (CHOSEN)
def test_matches_reference_on_gpu(dtype, causal, head_dim, config):
    lengths, heads, kv_heads = [1, 100, 128, 129, 777], 8, 2
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lengths), heads, head_dim, dtype=dtype, device="cuda")
    k, v = (torch.randn(sum(lengths), kv_heads, head_dim, dtype=dtype, device="cuda") for _ in range(2))
    out = torch.full_like(q, float("nan"))
    gluon_prefill(q, k, v, cu, max(lengths), head_dim ** -0.5, causal=causal, out=out, config=config,
                  lengths=lengths)
    cache = torch.zeros(1, 16, kv_heads, head_dim, dtype=dtype, device="cuda")
    ref = reference.prefill_attention(
        q, k, v, cache, cache, cu, torch.zeros(len(lengths), dtype=torch.int32, device="cuda"),
        torch.zeros(len(lengths), 1, dtype=torch.int32, device="cuda"), head_dim ** -0.5,
        causal=causal)
    tol = 2e-2 if dtype == torch.bfloat16 else 6e-3
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


@hopper
@pytest.mark.parametrize("dtype, head_dim, page, config", [
    (torch.bfloat16, 128, 16, None),                 # the backend's: ping-pong, a copy a page
    (torch.float16, 64, 16, BASE),                   # no producer warp: the consumers copy
    (torch.bfloat16, 128, 128, {**BASE, "WS": True, "PINGPONG": True, "num_warps": 4,
                                "PERSISTENT": True, "SNAKE": True}),   # a tile inside a page
    (torch.bfloat16, 64, 256, None),                # two tiles a page
    (torch.bfloat16, 128, 16, {**BASE, "WS": True, "PINGPONG": True, "num_warps": 4, "TREE": True}),
    (torch.bfloat16, 128, 16, {**BASE, "WS": True, "PINGPONG": True, "num_warps": 4, "LATE_K": True})])
def test_paged_matches_reference_on_gpu(paged_batch, dtype, head_dim, page, config):
    """Queries after cached context, every key read from the paged cache (permuted
    pages, the step's own K/V stored): against the plain-PyTorch paged attention."""
    contexts, lens = [0, 5, 130, 300, 0], [1, 100, 129, 257, 64]
    b = paged_batch(contexts, lens, 8, 2, head_dim, page, dtype=dtype, device="cuda")
    k_cache, v_cache = b.k_cache.nan_to_num(0.0), b.v_cache.nan_to_num(0.0)   # the pool's zeros
    out = torch.full_like(b.q, float("nan"))
    gluon_prefill_paged(b.q, k_cache, v_cache, b.cu_seqlens_q, b.seq_lens, b.block_tables,
                        max(lens), head_dim ** -0.5, out=out, config=config)
    ref = reference.paged_attention(b.q.float(), k_cache.float(), v_cache.float(),
                                    b.cu_seqlens_q.tolist(), b.seq_lens.tolist(), b.block_tables,
                                    head_dim ** -0.5, None)
    tol = 2e-2 if dtype == torch.bfloat16 else 6e-3
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def test_paged_inputs_are_checked(paged_batch):
    b = paged_batch([4, 0], [5, 3], 4, 2, 64, 16, dtype=torch.bfloat16)
    args = (b.q, b.k_cache, b.v_cache, b.cu_seqlens_q, b.seq_lens, b.block_tables)
    check_paged_inputs(*args, 128)
    for bad, match in ((lambda a: (a[0].float(), *a[1:]), "dtype"),
                       (lambda a: (a[0], a[1][:, :12], a[2][:, :12], *a[3:]), "page"),
                       (lambda a: (*a[:4], a[4].long(), a[5]), "int32"),
                       (lambda a: (*a[:5], a[5].t()), "int32")):
        with pytest.raises(ValueError, match=match):
            check_paged_inputs(*bad(args), 128)
    with pytest.raises(ValueError, match="sm_90"):
        gluon_prefill_paged(*args, 5, 0.1)
    with pytest.raises(ValueError, match="TABLE"):
        kernel_args(b.q, b.k_cache, b.v_cache, b.q, b.cu_seqlens_q, 5, 0.1, True,
                    {"WS": True, "TABLE": True}, [5, 3], paged=(b.seq_lens, b.block_tables))


def _prefill_step(b):
    from slipstream.batch import ForwardBatch
    q_lens = (b.cu_seqlens_q[1:] - b.cu_seqlens_q[:-1]).tolist()
    n = b.q.shape[0]
    return ForwardBatch(
        input_ids=torch.zeros(n, dtype=torch.long), positions=torch.zeros(n, dtype=torch.long),
        query_start_loc=b.cu_seqlens_q, seq_lens=b.seq_lens, context_lens=b.context_lens,
        slot_mapping=b.slot_mapping, block_tables=b.block_tables,
        logits_indices=torch.zeros(0, dtype=torch.long), max_query_len=max(q_lens),
        max_seq_len=int(b.seq_lens.max()), query_lens_cpu=q_lens, seq_lens_cpu=b.seq_lens.tolist())


@pytest.mark.parametrize("context, window, takes_gluon", [
    ([0, 0], None, "whole"),   # whole prompts
    ([0, 24], None, "paged"),  # a prompt chunk after cached context
    ([0, 0], 5, None),         # sliding window
])
def test_backend_routes_prompts_to_gluon(paged_batch, monkeypatch, context, window, takes_gluon):
    """Opted in on sm_90 (both faked here), whole-prompt steps go to the Gluon
    kernel with the step's own K/V, steps after cached context to its paged form
    over the cache (the step's K/V stored first); sliding windows, and a layer the
    kernel refuses (ValueError), to the portable kernel, whose output stays correct."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors through the portable kernels: Triton's interpreter (no GPU)")
    from types import SimpleNamespace
    from slipstream.attention import triton_backend as tb
    b = paged_batch(context, [19, 9], 4, 2, 64, 16, store_new=False)
    layer = SimpleNamespace(layer_idx=0, num_heads=4, num_kv_heads=2, head_dim=64, scale=0.125,
                            sliding_window=window, k_cache=b.k_cache.clone(),
                            v_cache=b.v_cache.clone(), k_scale=None, v_scale=None)
    calls = []

    def fake(q, k, v, cu, max_len, scale, causal, lengths):
        assert lengths == b.seq_lens.tolist()
        calls.append((q.shape, k.shape, max_len, scale, causal))
        return torch.full_like(q, 7.0)

    def fake_paged(q, k_cache, v_cache, cu, kv_lens, tables, max_len, scale, causal, out):
        assert k_cache is layer.k_cache and kv_lens is batch.seq_lens
        # The step's own K/V are in the cache before the kernel reads it.
        slots = b.slot_mapping
        assert torch.equal(k_cache.flatten(0, 1)[slots], b.k)
        calls.append(("paged", max_len, scale, causal))
        return (torch.empty_like(q) if out is None else out).fill_(7.0)

    monkeypatch.setattr(tb, "gluon_prefill_wanted", lambda device: True)
    monkeypatch.setattr(tb, "gluon_prefill", fake)
    monkeypatch.setattr(tb, "gluon_prefill_paged", fake_paged)
    batch = _prefill_step(b)
    backend = tb.TritonAttentionBackend()
    backend.prepare(batch)
    out = backend.forward(b.q, b.k, b.v, layer, batch)
    assert bool((out == 7.0).all()) == (takes_gluon is not None)
    assert calls == {"whole": [(b.q.shape, b.k.shape, 19, 0.125, True)],
                     "paged": [("paged", 19, 0.125, True)], None: []}[takes_gluon]

    def refuse(*args, **kwargs):
        raise ValueError("head_dim")
    monkeypatch.setattr(tb, "gluon_prefill", refuse)
    monkeypatch.setattr(tb, "gluon_prefill_paged", refuse)
    backend.prepare(batch)
    layer.k_cache, layer.v_cache = b.k_cache.clone(), b.v_cache.clone()
    out = backend.forward(b.q, b.k, b.v, layer, batch)
    k_ref, v_ref = b.k_cache.clone(), b.v_cache.clone()
    reference.store_kv(b.k, b.v, k_ref, v_ref, b.slot_mapping)
    ref = reference.paged_attention(b.q.float(), k_ref.float(), v_ref.float(), b.cu_seqlens_q.tolist(),
                                    b.seq_lens.tolist(), b.block_tables, 0.125, window)
    torch.testing.assert_close(out.float(), ref.float(), atol=4e-3, rtol=4e-3)


def test_gluon_not_wanted_without_a_gpu(monkeypatch):
    from slipstream.kernels.gluon_prefill import gluon_prefill_wanted
    monkeypatch.setenv("SLIPSTREAM_GLUON_PREFILL", "1")
    assert not gluon_prefill_wanted(torch.device("cpu"))
    monkeypatch.setenv("SLIPSTREAM_GLUON_PREFILL", "0")
    assert not gluon_prefill_wanted(torch.device("cpu"))

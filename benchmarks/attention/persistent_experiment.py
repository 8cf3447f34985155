"""Experiment: a persistent prefill kernel whose K/V pipeline runs on across
query blocks.

The production prefill kernel (prefill_attention.py) gives each program one
query block; every program then pays its own prologue (sequence bounds, Q and
the first K/V tiles, dependent memory round trips) and epilogue (normalise,
store) with nothing to overlap them, since one 128x128 program fills an SM.
Here a grid of one program per SM walks a list of (query block, head, request)
items, and the outer loop is flattened (`tl.range(..., flatten=True)`) into the
inner K/V loop, so the software pipeline can fetch the next item's first tiles
while the current item finishes. Dense equal-length batches only: a probe for
whether the shape pays before the production kernel takes it.

What it found (H200, results/persistent_probe_h200_2026-11-29.jsonl, Triton
3.6): the nest is flattened only without the causal mask's varying trip count,
only with pointer loads (TMA loads in a flattened loop fail to lower), and the
flattened kernel's output is wrong (relative error 0.13-0.19, the same kernel
unflattened is exact). Unflattened, the persistent pointer-load kernel reaches
325 TFLOP/s at 4k causal against 450 for the production kernel. The shape does
not pay in this Triton.

    python benchmarks/attention/persistent_experiment.py            # H200: time
    python benchmarks/attention/persistent_experiment.py --compile  # sm_90 offline
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE)]

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from slipstream.kernels.attention_tile import softmax_tile_update  # noqa: E402

LOG2E = 1.4426950408889634
CONFIGS = [  # (BLOCK_M, BLOCK_N, warps, stages, flatten)
    (128, 128, 8, 2, True), (128, 128, 8, 2, False), (128, 64, 8, 3, True), (128, 64, 8, 2, True),
]


@triton.jit
def _persistent_kernel(Q, K, V, O, n_ctx, num_heads, num_items, qk_scale, stride_t, stride_kt,
                       GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, FLATTEN: tl.constexpr):
    # Pointer loads (cp.async), not TMA descriptors, and one inner loop (the
    # causal mask applied on every tile): Triton 3.6 flattens only a loop nest
    # with a single inner loop, and fails lowering TMA loads in a flattened one.
    num_m = n_ctx // BLOCK_M
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    for item in tl.range(tl.program_id(0), num_items, tl.num_programs(0), flatten=FLATTEN):
        # Items in the production grid's order: query blocks fastest, latest first.
        m_block = num_m - 1 - item % num_m
        head = (item // num_m) % num_heads
        row0 = item // (num_m * num_heads) * n_ctx
        rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        q = tl.load(Q + (row0 + rows)[:, None] * stride_t + head * HEAD_DIM + offs_d[None, :])
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        kv = head // GROUP * HEAD_DIM
        hi = (m_block + 1) * BLOCK_M if CAUSAL else n_ctx
        for start in tl.range(0, hi, BLOCK_N):
            j = row0 + start + offs_n
            k = tl.load(K + j[None, :] * stride_kt + kv + offs_d[:, None])
            v = tl.load(V + j[:, None] * stride_kt + kv + offs_d[None, :])
            qk = tl.dot(q, k)
            mask = rows[:, None] >= start + offs_n[None, :]
            acc, m_i, l_i = softmax_tile_update(acc, m_i, l_i, qk, v, qk_scale, mask, CAUSAL)
        tl.store(O + (row0 + rows)[:, None] * stride_t + head * HEAD_DIM + offs_d[None, :],
                 (acc / l_i[:, None]).to(O.dtype.element_ty))


def persistent_attention(q, k, v, n_ctx: int, causal: bool, config, sms: int) -> torch.Tensor:
    """q: [B * n_ctx, H, D], k/v: [B * n_ctx, Hkv, D] bf16, contiguous; n_ctx a
    multiple of BLOCK_M."""
    bm, bn, warps, stages, flatten = config
    tokens, heads, d = q.shape
    out = torch.empty_like(q)
    items = tokens // bm * heads
    _persistent_kernel[(min(items, sms),)](
        q, k, v, out, n_ctx, heads, items, d ** -0.5 * LOG2E, q.stride(0), k.stride(0),
        GROUP=heads // k.shape[1], HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal,
        FLATTEN=flatten, num_warps=warps, num_stages=stages)
    return out


def _name(cfg) -> str:
    bm, bn, warps, stages, flatten = cfg
    return f"M{bm}_N{bn}_w{warps}_s{stages}" + ("_flat" if flatten else "")


def compile_offline() -> None:
    """Shared memory, registers, spills and loop count of each config on sm_90."""
    import compile_report as cr
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    fn = _persistent_kernel
    for cfg, causal in [(c, causal) for c in CONFIGS for causal in (True, False)]:
        bm, bn, warps, stages, flatten = cfg
        consts = dict(GROUP=1, HEAD_DIM=128, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, FLATTEN=flatten)
        sig = {**{p: "*bf16" for p in "QKVO"}, "n_ctx": "i32", "num_heads": "i32", "num_items": "i32",
               "qk_scale": "fp32", "stride_t": "i32", "stride_kt": "i32",
               **{c: "constexpr" for c in consts}}
        attrs = {(fn.arg_names.index(p),): [["tt.divisibility", 16]]
                 for p in ("Q", "K", "V", "O", "stride_t", "stride_kt")}
        src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(c),): v for c, v in consts.items()},
                        attrs=attrs)
        saved = os.dup(2)  # compiler failures dump whole modules to stderr
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
            kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                    options=dict(num_warps=warps, num_stages=stages))
            regs, stack = cr.ptxas_usage(kernel.asm["ptx"])
            row = {"shared": kernel.metadata.shared, "registers": regs, "stack": stack,
                   "flattened": kernel.asm["ttgir"].count("scf.if") > 0,
                   "wgmma": kernel.asm["ptx"].count("wgmma.mma_async")}
        except Exception as e:  # noqa: BLE001 - a config that does not compile is a result
            row = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        finally:
            os.dup2(saved, 2)
        print(json.dumps({"config": _name(cfg), "causal": causal, **row}), flush=True)


def time_on_gpu() -> None:
    import prefill_cases
    from timing import bench_ms, cu_seqlens, interleaved, rel_err
    from torch.nn.attention import SDPBackend
    from slipstream.kernels.prefill_attention import prefill_attention
    heads, d, tokens = prefill_cases.HEADS, prefill_cases.HEAD_DIM, prefill_cases.TOKENS
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for n, causal in ((4096, True), (16384, True), (4096, False), (1024, True)):
        b = tokens // n
        q, k, v = (torch.randn(tokens, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = prefill_cases.attn_flops([n] * b, [n] * b, causal)
        ref = prefill_cases._sdpa(q, k, v, b, n, causal, SDPBackend.FLASH_ATTENTION)()
        ref = ref.transpose(1, 2).reshape_as(q)
        cache = torch.empty(1, 16, heads, d, device="cuda", dtype=torch.bfloat16)
        ctx = torch.zeros(b, dtype=torch.int32, device="cuda")
        tables = torch.zeros(b, 1, dtype=torch.int32, device="cuda")
        cu = cu_seqlens([n] * b, "cuda")
        row = {"N": n, "causal": causal}
        calls = {"sdpa_cudnn": prefill_cases._sdpa(q, k, v, b, n, causal, SDPBackend.CUDNN_ATTENTION),
                 "ours_tuned": lambda: prefill_attention(q, k, v, cache, cache, cu, ctx, tables, n,
                                                         d ** -0.5, causal=causal)}
        for cfg in CONFIGS:
            try:
                row[_name(cfg) + "_err"] = rel_err(persistent_attention(q, k, v, n, causal, cfg, sms), ref)
                calls[_name(cfg)] = lambda cfg=cfg: persistent_attention(q, k, v, n, causal, cfg, sms)
            except Exception as e:  # noqa: BLE001
                row[_name(cfg) + "_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        for name, t in interleaved({nm: lambda fn=fn: bench_ms(fn) for nm, fn in calls.items()}, 3).items():
            row[name] = round(flops / t["ms"] / 1e9, 1)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile", action="store_true", help="compile for sm_90 offline and report")
    args = ap.parse_args()
    compile_offline() if args.compile else time_on_gpu()

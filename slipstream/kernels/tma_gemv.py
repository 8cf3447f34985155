"""One row times a 16-bit weight (the batch-1 decode GEMV) on Hopper, in Gluon, with
its weight streamed by TMA and, optionally, the RMSNorm before it folded in.

y[n] = sum_k x[k] * w[n, k], w as nn.Linear keeps it ([N, K], rows contiguous).
Program i owns BLOCK_N output features and streams their whole rows through a ring
of STAGES shared-memory slots ([BLOCK_N, BLOCK_K] tiles, unswizzled) filled by TMA;
x is read once into shared memory, and the warps multiply a slot by the matching
slice of x and accumulate elementwise in fp32, summing over K once at the end. No
split over K, no reduce kernel.

The weight is written by no kernel of a step, so under programmatic dependent
launch (CHAIN) a program issues its first STAGES copies *before* it waits on the
kernel ahead of it (`griddepcontrol.wait`): while that kernel (attention, a norm:
latency-bound, the memory otherwise idle) finishes, up to STAGES tiles of every
resident program are already on their way.

NORM: x is the residual stream, and the layer's RMSNorm is applied on the fly, with
the rounding steps of kernels/rms_norm.py (Hugging Face's):
    s = x + residual (ADD; rounded to the model dtype), written to ResOut by program 0
    normed = weight * (s_fp32 * rsqrt(mean(s_fp32^2) + eps)).to(dtype)
so the GEMV multiplies exactly the row the separate norm kernel would have written
(each program normalises the 8 KB row itself, into its shared copy of x).
ACT: x is the gate/up projection's output [gate | up] and the GEMV multiplies
silu(gate) * up, rounded as kernels/silu_mul.py rounds it (the down projection).

sm_90 only (TMA, mbarrier); the plain-PyTorch twin is `reference`, the engine's
other paths are F.linear and kernels/rms_norm.py.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from slipstream.kernels.runtime import capability, num_sms

DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
DEFAULT_CONFIG = {"BLOCK_N": 16, "BLOCK_K": 256, "STAGES": 4, "num_warps": 4}


@gluon.jit
def _gdc_wait():
    gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _gdc_launch_dependents():
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [],
                              dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _issue(w_desc, bufs, ready, t, total, pid, G, n_k, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
           STAGES: gl.constexpr):
    """Copy flat tile t of this program (row block pid + (t // n_k) * G, K slice t % n_k)
    into ring slot t % STAGES, if there is such a tile."""
    s = t % STAGES
    blk = pid + (t // n_k) * G
    mbarrier.expect(ready.index(s), w_desc.block_type.nbytes, pred=t < total)
    tma.async_copy_global_to_shared(w_desc, [blk * BLOCK_N, (t % n_k) * BLOCK_K], ready.index(s),
                                    bufs.index(s), pred=t < total)


@gluon.jit
def _ring(w_desc, total, pid, G, n_k, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
          STAGES: gl.constexpr, CHAIN: gl.constexpr):
    """The ring of STAGES [BLOCK_N, BLOCK_K] slots and their barriers, its first copies
    issued, then (CHAIN) the wait on the kernel ahead and the early launch of the next."""
    bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(STAGES):
        mbarrier.init(ready.index(j), count=1)
    fence_async_shared()
    for j in gl.static_range(STAGES):  # the weight: before the wait on the kernel ahead
        _issue(w_desc, bufs, ready, j, total, pid, G, n_k, BLOCK_N, BLOCK_K, STAGES)
    if CHAIN:
        _gdc_wait()
        _gdc_launch_dependents()
    return bufs, ready


@gluon.jit(do_not_specialize=["N", "K", "eps"])
def _gemv_kernel(w_desc, X, Res, NormW, ResOut, Y, N, K, eps,
                 BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                 NORM: gl.constexpr, ADD: gl.constexpr, ACT: gl.constexpr,
                 K_TILES: gl.constexpr, CHAIN: gl.constexpr, num_warps: gl.constexpr):
    TPW_K: gl.constexpr = BLOCK_K // 8
    tile: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPW_K, TPW_K], [num_warps, 1], [1, 0])
    vec: gl.constexpr = gl.SliceLayout(0, tile)
    pid = gl.program_id(0)
    G = gl.num_programs(0)
    n_k = gl.cdiv(K, BLOCK_K)
    total = gl.cdiv(gl.cdiv(N, BLOCK_N) - pid, G) * n_k  # this program's tiles
    bufs, ready = _ring(w_desc, total, pid, G, n_k, BLOCK_N, BLOCK_K, STAGES, CHAIN)
    # x (after the residual add, normalised), read at once, into shared memory
    rows = gl.arange(0, K_TILES, layout=gl.SliceLayout(1, tile))
    k2 = rows[:, None] * BLOCK_K + gl.arange(0, BLOCK_K, layout=vec)[None, :]
    ok = k2 < K
    x = gl.load(X + k2, mask=ok, other=0.0)
    if ACT:  # X = [gate | up], 2K wide: silu(gate) * up, rounded as kernels/silu_mul.py
        g = x.to(gl.float32)
        act = (g * (1 / (1 + gl.exp(-g)))).to(x.dtype).to(gl.float32)  # tl.sigmoid
        x = (act * gl.load(X + K + k2, mask=ok, other=0.0).to(gl.float32)).to(x.dtype)
    if ADD:
        x = (x.to(gl.float32) + gl.load(Res + k2, mask=ok, other=0.0).to(gl.float32)).to(x.dtype)
        if pid == 0:
            gl.store(ResOut + k2, x, mask=ok)
    if NORM:  # the norm kernel's rounding steps
        h = x.to(gl.float32)
        rstd = gl.rsqrt(gl.sum(gl.sum(h * h, axis=1), axis=0) / K + eps)
        normed = (h * rstd).to(x.dtype).to(gl.float32)
        x = (gl.load(NormW + k2, mask=ok, other=0.0).to(gl.float32) * normed).to(x.dtype)
    x_smem = gl.allocate_shared_memory(x.dtype, [K_TILES, BLOCK_K],
                                       gl.SwizzledSharedLayout(1, 1, 1, [1, 0]), x)
    # the same bytes as K_TILES rows of a rank-1 layout, so that index(i) picks row i
    x_rows = x_smem._reinterpret(x.dtype, [K_TILES, BLOCK_K], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    gl.thread_barrier()
    acc = gl.zeros([BLOCK_N, BLOCK_K], gl.float32, tile)
    n_out = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, tile))
    for t in range(total):
        s = t % STAGES
        kk = t % n_k
        xk = x_rows.index(kk).load(vec).to(gl.float32)
        mbarrier.wait(ready.index(s), (t // STAGES) & 1)
        w = bufs.index(s).load(tile).to(gl.float32)
        acc += w * xk[None, :]
        gl.thread_barrier()  # every warp is done with slot s: refill it
        _issue(w_desc, bufs, ready, t + STAGES, total, pid, G, n_k, BLOCK_N, BLOCK_K, STAGES)
        if kk == n_k - 1:  # a row block is done
            n = (pid + (t // n_k) * G) * BLOCK_N + n_out
            gl.store(Y + n, gl.sum(acc, axis=1).to(Y.dtype.element_ty), mask=n < N)
            acc = gl.zeros([BLOCK_N, BLOCK_K], gl.float32, tile)
    for j in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(j))


def descriptor(t: torch.Tensor, block: list[int], cache: dict | None = None) -> TensorDescriptor:
    """The TMA descriptor of a 2-D tensor no kernel moves (a weight), unswizzled boxes of
    `block`. cache: a dict its owner keeps for that one tensor (the layer's,
    `descriptors_of`), so a descriptor is made once and lives no longer than the owner;
    when the owner's tensor is replaced, the old one's descriptors go. None: made anew."""
    key = (tuple(block), t.dtype)
    desc = None if cache is None else cache.get(key)
    if desc is None or desc.base is not t:
        layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=t.element_size() * 8,
                                      rank=2)
        desc = TensorDescriptor(t, list(t.shape), [t.stride(0), 1], list(block), layout)
        if cache is not None:
            for stale in [k for k, d in cache.items() if d.base is not t]:
                del cache[stale]
            cache[key] = desc
    return desc


def descriptors_of(owner) -> dict:
    """The descriptor cache an object (a layer) keeps for the one tensor it streams."""
    cache = owner.__dict__.get("_tma_descriptors")
    if cache is None:
        cache = owner.__dict__["_tma_descriptors"] = {}
    return cache


# x is held whole in each program's registers (then shared memory) while it is staged
K_MAX = 16384


def check_inputs(x: torch.Tensor, w: torch.Tensor, silu_mul: bool = False) -> None:
    """ValueError unless x is one 16-bit row on an sm_90 GPU and w a matching weight."""
    if not (x.is_cuda and capability(x.device.index or 0)[0] == 9):
        raise ValueError("tma_gemv needs an sm_90 GPU (TMA, mbarriers)")
    if x.dim() != 2 or x.shape[0] != 1:
        raise ValueError(f"tma_gemv: x must be one row [1, K], got {tuple(x.shape)}")
    if x.dtype not in DTYPES or w.dtype != x.dtype:
        raise ValueError(f"tma_gemv: x and w must share a 16-bit dtype, got {x.dtype} / {w.dtype}")
    n, k = w.shape
    if x.shape[1] != (2 * k if silu_mul else k):
        raise ValueError(f"tma_gemv: x is {x.shape[1]} wide for a weight of {k} inputs"
                         + (" (silu_mul takes [gate | up], 2K wide)" if silu_mul else ""))
    if not w.is_contiguous() or k % 8 or w.data_ptr() % 16:
        raise ValueError("tma_gemv: the weight must be contiguous with 16-byte aligned rows")
    if k > K_MAX:
        raise ValueError(f"tma_gemv: at most {K_MAX} inputs, got {k}")


def tma_gemv(x: torch.Tensor, w: torch.Tensor, *, norm_weight: torch.Tensor | None = None,
             eps: float = 1e-6, residual: torch.Tensor | None = None,
             residual_out: torch.Tensor | None = None, silu_mul: bool = False,
             out: torch.Tensor | None = None, chain: bool = False,
             config: dict | None = None, descriptors: dict | None = None) -> torch.Tensor:
    """x [1, K] @ w[N, K]^T -> [1, N]. With norm_weight: x is the residual stream and the
    product is taken with rms_norm(x (+ residual)) (residual_out receives x + residual).
    silu_mul: x is [1, 2K] = [gate | up] and the product is taken with silu(gate) * up.
    descriptors: where w's TMA descriptor is kept between calls (`descriptors_of`)."""
    cfg = {**DEFAULT_CONFIG, **(config or {})}
    check_inputs(x, w, silu_mul)
    n, k = w.shape
    cfg["BLOCK_K"] = min(cfg["BLOCK_K"], max(16, 1 << (k - 1).bit_length()))  # small K: one tile
    x = x.contiguous()
    y = out if out is not None else torch.empty(1, n, device=x.device, dtype=x.dtype)
    norm = norm_weight is not None
    add = residual is not None
    if add and (residual_out is None or residual_out.data_ptr() == residual.data_ptr()):
        raise ValueError("tma_gemv: a residual needs a residual_out of its own (program 0 "
                         "writes it while the others read the residual)")
    if silu_mul and norm:
        raise ValueError("tma_gemv: silu_mul and a norm do not combine")
    tiles = -(-k // cfg["BLOCK_K"])
    k_tiles = 1 << max(0, (tiles - 1).bit_length())
    desc = descriptor(w, [cfg["BLOCK_N"], cfg["BLOCK_K"]], descriptors)
    blocks = triton_cdiv(n, cfg["BLOCK_N"])
    # PROGRAMS a SM (0: one program a row block); a program walks blocks pid, pid + G, ..
    per_sm = cfg.get("PROGRAMS", 0)
    grid = (blocks if not per_sm else min(blocks, per_sm * num_sms(x.device.index or 0)),)
    _gemv_kernel[grid](desc, x, residual if add else x, norm_weight if norm else x,
                       residual_out if add else x, y, n, k, eps,
                       BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], STAGES=cfg["STAGES"],
                       NORM=norm, ADD=add, ACT=silu_mul, K_TILES=k_tiles, CHAIN=chain,
                       num_warps=cfg["num_warps"], launch_pdl=chain)
    return y


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def reference(x: torch.Tensor, w: torch.Tensor, *, norm_weight: torch.Tensor | None = None,
              eps: float = 1e-6, residual: torch.Tensor | None = None,
              silu_mul: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-PyTorch twin: (y, the residual stream after the add)."""
    if silu_mul:
        g, u = x.chunk(2, dim=-1)
        x = F.silu(g.float()).to(x.dtype) * u
    s = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    a = s
    if norm_weight is not None:
        h = s.float()
        normed = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
        a = (norm_weight.float() * normed.float()).to(x.dtype)
    return F.linear(a, w), s

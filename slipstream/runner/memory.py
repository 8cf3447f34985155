"""Sizing and allocating the paged KV pool.

The pool is one tensor [num_layers, 2, num_blocks, block_size, num_kv_heads,
head_dim]; each attention layer gets views of its K and V halves. With a
quantized cache (`kv_cache_dtype` int8 / fp8, quant/kv_quant.py) the pool holds
1-byte codes and a second pool [num_layers, 2, num_blocks, block_size,
num_kv_heads] fp32 holds one scale per token and head beside them; the sizing
counts both, so the same memory holds about twice the tokens.

On CUDA the pool gets what `gpu_memory_utilization` leaves after the weights
and the peak working memory of one step, which is measured, not guessed: a
profiling forward of a full token budget (and the logits and sampling of a full
batch of sequences) runs before the pool exists. The same run compiles and
tunes the prefill kernels for every query-length bucket, so no serving step
autotunes.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from slipstream.config import CacheConfig, ModelConfig, SchedulerConfig
from slipstream.errors import SlipstreamError
from slipstream.quant.kv_quant import kv_format

DEFAULT_CPU_KV_BYTES = 1 << 30
SCALE_BYTES = 4   # one fp32 scale per token and KV head in a quantized cache


def kv_bytes_per_token(mc: ModelConfig, dtype: torch.dtype, kv_cache_dtype: str = "auto",
                       block_size: int = 16) -> int:
    """K and V bytes of one token over all layers, scales included (KIVI: sealed
    blocks, whose key scales are shared by the block's tokens)."""
    fmt = kv_format(kv_cache_dtype)
    if fmt.kivi_bits:
        from slipstream.cache.kivi_paged import kivi_bytes_per_token
        return math.ceil(mc.num_hidden_layers * kivi_bytes_per_token(
            mc.num_key_value_heads, mc.head_dim, fmt.kivi_bits, block_size))
    elem = torch.empty((), dtype=fmt.storage or dtype).element_size()
    per_head = mc.head_dim * elem + (SCALE_BYTES if fmt.quantized else 0)
    return 2 * mc.num_hidden_layers * mc.num_key_value_heads * per_head


def activation_reserve_bytes(mc: ModelConfig, sc: SchedulerConfig, dtype: torch.dtype) -> int:
    """A generous bound on the working memory of one step, kept out of the KV
    pool: hidden states and MLP intermediates of the token budget, plus fp32
    logits and sampling scratch for every running sequence."""
    elem = torch.empty((), dtype=dtype).element_size()
    t = sc.max_num_batched_tokens
    per_token = (4 * mc.hidden_size + 3 * mc.intermediate_size
                 + (mc.num_attention_heads + 2 * mc.num_key_value_heads) * mc.head_dim)
    return 2 * t * per_token * elem + 4 * sc.max_num_seqs * mc.vocab_size * 4


log = logging.getLogger("slipstream")


@dataclass
class KVPlan:
    num_blocks: int
    block_size: int
    kv_bytes_per_token: int
    peak_activation_bytes: int   # measured on CUDA; the estimate elsewhere
    max_model_len: int
    measured: bool = False
    kv_cache_dtype: str = "auto"

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def max_concurrency(self) -> float:
        """How many sequences of max_model_len tokens fit at once."""
        return self.capacity_tokens / self.max_model_len

    def describe(self) -> str:
        kind = "" if self.kv_cache_dtype == "auto" else f" {self.kv_cache_dtype}"
        return (f"KV cache{kind}: {self.num_blocks} blocks of {self.block_size} tokens = "
                f"{self.capacity_tokens} tokens ({self.capacity_tokens * self.kv_bytes_per_token / 2**30:.2f} GiB), "
                f"{self.max_concurrency:.1f}x concurrency at {self.max_model_len} tokens per sequence; "
                f"step working memory {self.peak_activation_bytes / 2**20:.0f} MiB "
                f"({'measured' if self.measured else 'estimated'})")


def plan_kv_cache(model, config, graph_pool: bool = False) -> KVPlan:
    """Size the KV pool for `model` (weights loaded) under `config`. graph_pool: CUDA
    graphs of whole prompt steps will hold a step's working memory of their own."""
    mc, sc, cc = config.model_config, config.scheduler, config.cache
    dtype, device = config.dtype, config.device
    reserve = activation_reserve_bytes(mc, sc, dtype)
    measured = device.type == "cuda"
    if measured:   # also compiles and tunes the prefill kernels, whatever sizes the pool
        reserve = profile_step_memory(model, config)
        if graph_pool:
            reserve *= 2
    n = num_kv_blocks(cc, mc, sc, dtype, device, reserve)
    plan = KVPlan(n, cc.block_size, kv_bytes_per_token(mc, dtype, cc.kv_cache_dtype, cc.block_size),
                  reserve,
                  sc.max_model_len, measured, kv_format(cc.kv_cache_dtype).name)
    log.info(plan.describe())
    return plan


@torch.inference_mode()
def profile_step_memory(model, config) -> int:
    """Peak bytes one step allocates beyond the weights: a forward of a full
    token budget over a scratch KV pool, then logits and top-p sampling of
    `max_num_seqs` rows. Also warms up every prefill kernel bucket."""
    from slipstream.batch import ForwardBatch
    from slipstream.layers.sampler import Sampler, SamplingBatch
    from slipstream.sampling_params import SamplingParams
    mc, sc, cc = config.model_config, config.scheduler, config.cache
    device = config.device
    tokens = sc.max_num_batched_tokens
    bs = cc.block_size
    per_seq = min(tokens, sc.max_model_len)
    num_seqs = -(-tokens // per_seq)
    blocks_per_seq = -(-per_seq // bs)
    scratch = allocate_kv_cache(num_seqs * blocks_per_seq, cc, mc, config.dtype, device)
    scratch_scales = allocate_kv_scales(num_seqs * blocks_per_seq, cc, mc, device)
    layers = model.attention_layers()
    bind_kv_cache(layers, scratch, scratch_scales,
                  allocate_kivi(num_seqs * blocks_per_seq, cc, mc, config.dtype, device))
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    # One query-length bucket per power of two: compiles (and tunes) each once.
    for q in sorted({min(1 << k, per_seq) for k in range(0, math.ceil(math.log2(per_seq)) + 1)}):
        n = min(num_seqs, max(1, tokens // q))
        lens = [q] * n
        model.backend.prepare(_dummy_batch(ForwardBatch, lens, blocks_per_seq, bs, device))
        model(_dummy_batch(ForwardBatch, lens, blocks_per_seq, bs, device))
    rows = sc.max_num_seqs
    logits = model.compute_logits(torch.zeros(rows, mc.hidden_size, dtype=config.dtype, device=device))
    params = [SamplingParams(temperature=0.7, top_p=0.9, top_k=50)] * rows
    Sampler()(logits, SamplingBatch.build(params, [[0]] * rows, [[0]] * rows, [None] * rows,
                                          mc.vocab_size, device))
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del scratch, scratch_scales, logits
    for layer in layers:
        layer.k_cache = layer.v_cache = layer.k_scale = layer.v_scale = None
    torch.cuda.empty_cache()
    return int(peak * 1.1)


def _dummy_batch(cls, lens: list[int], blocks_per_seq: int, bs: int, device):
    n = len(lens)
    loc = [0]
    for q in lens:
        loc.append(loc[-1] + q)
    t = loc[-1]
    pos = torch.cat([torch.arange(q) for q in lens])
    seq = torch.repeat_interleave(torch.arange(n), torch.tensor(lens))
    tables = torch.arange(n * blocks_per_seq, dtype=torch.int32).view(n, blocks_per_seq)
    slots = tables.long()[seq, pos // bs] * bs + pos % bs
    i32 = dict(dtype=torch.int32, device=device)
    b = cls(input_ids=torch.zeros(t, dtype=torch.int64, device=device), positions=pos.to(device),
            query_start_loc=torch.tensor(loc, **i32), seq_lens=torch.tensor(lens, **i32),
            context_lens=torch.zeros(n, **i32), slot_mapping=slots.to(device),
            block_tables=tables.to(device), logits_indices=torch.tensor([t - 1], device=device),
            max_query_len=max(lens), max_seq_len=max(lens), query_lens_cpu=lens, seq_lens_cpu=lens,
            num_decode_seqs=n if max(lens) == 1 else 0)
    return b


def num_kv_blocks(cc: CacheConfig, mc: ModelConfig, sc: SchedulerConfig,
                  dtype: torch.dtype, device: torch.device, reserve: int | None = None) -> int:
    per_block = kv_bytes_per_token(mc, dtype, cc.kv_cache_dtype, cc.block_size) * cc.block_size
    if cc.num_blocks is not None:
        n = cc.num_blocks
    elif device.type == "cuda":
        # Our share of the card minus what others use and what this process
        # holds live (weights, other engines); memory our allocator merely
        # keeps cached is still ours to hand out.
        free, total = torch.cuda.mem_get_info(device)
        others = total - free - torch.cuda.memory_reserved(device)
        budget = int(total * cc.gpu_memory_utilization) - others - torch.cuda.memory_allocated(device)
        if reserve is None:
            reserve = activation_reserve_bytes(mc, sc, dtype)
        if kv_format(cc.kv_cache_dtype).kivi_bits:   # the window pool, allocated up front
            reserve += kivi_window_bytes(cc, mc, sc, dtype)[1]
        n = (budget - reserve) // per_block
    else:
        n = (cc.cpu_kv_cache_bytes or DEFAULT_CPU_KV_BYTES) // per_block
    need = -(-sc.max_model_len // cc.block_size)
    if n < need:
        raise SlipstreamError(
            f"the KV cache holds {max(n, 0) * cc.block_size} tokens, fewer than one sequence of "
            f"max_model_len={sc.max_model_len}; lower max_model_len or give the cache more memory")
    return int(n)


def allocate_kv_cache(num_blocks: int, cc: CacheConfig, mc: ModelConfig,
                      dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The pool [layers, 2, blocks, block_size, kv_heads, head_dim] in the model
    dtype, or in the codes' dtype of a quantized `cc.kv_cache_dtype` (KIVI: an
    empty pool; `allocate_kivi` holds its blocks)."""
    fmt = kv_format(cc.kv_cache_dtype)
    if fmt.kivi_bits:
        num_blocks = 0
    dtype = fmt.storage or dtype
    # Zeroed so that a kernel reading a padded tile never meets NaN bit patterns.
    if device.type == "cpu":
        # calloc'd by numpy: the OS hands out zero pages as they are first touched, so
        # allocating costs no time and resident memory grows only with the tokens cached
        import numpy as np
        shape = (mc.num_hidden_layers, 2, num_blocks, cc.block_size, mc.num_key_value_heads, mc.head_dim)
        nbytes = kv_bytes_per_token(mc, dtype) * num_blocks * cc.block_size   # codes only
        return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)
    return torch.zeros(mc.num_hidden_layers, 2, num_blocks, cc.block_size,
                       mc.num_key_value_heads, mc.head_dim, dtype=dtype, device=device)


def allocate_kv_scales(num_blocks: int, cc: CacheConfig, mc: ModelConfig,
                       device: torch.device) -> torch.Tensor | None:
    """The scales of a quantized cache, [layers, 2, blocks, block_size, kv_heads]
    fp32, zeroed (a padded slot dequantizes to 0); None for a 16-bit cache."""
    if not kv_format(cc.kv_cache_dtype).per_token:
        return None
    return torch.zeros(mc.num_hidden_layers, 2, num_blocks, cc.block_size,
                       mc.num_key_value_heads, dtype=torch.float32, device=device)


def kivi_window_bytes(cc: CacheConfig, mc: ModelConfig, sc: SchedulerConfig,
                      dtype: torch.dtype) -> tuple[int, int]:
    """(slots, bytes over all layers) of a KIVI cache's full-precision window pool at its
    most: every running request's window (its residual blocks, the block it fills and
    one it may just have finished) plus the blocks one step's tokens may open."""
    from slipstream.cache.kivi_paged import RESIDUAL_TOKENS
    bs = cc.block_size
    slots = sc.max_num_seqs * (-(-RESIDUAL_TOKENS // bs) + 2) + -(-sc.max_num_batched_tokens // bs)
    per_slot = 2 * bs * mc.num_key_value_heads * mc.head_dim * torch.tensor([], dtype=dtype).element_size()
    return slots, slots * per_slot * mc.num_hidden_layers


def allocate_kivi(num_blocks: int, cc: CacheConfig, mc: ModelConfig, dtype: torch.dtype,
                  device: torch.device, sc: SchedulerConfig | None = None) -> list | None:
    """A KIVI cache's blocks, one `PagedKIVI` a layer (its window in `dtype`); None
    for the other formats. On a GPU with `sc` the window pool is allocated at its most
    (`kivi_window_bytes`, which the pool planner set aside), so it never grows while
    serving; elsewhere it starts small and grows as needed."""
    bits = kv_format(cc.kv_cache_dtype).kivi_bits
    if not bits:
        return None
    from slipstream.cache.kivi_paged import PagedKIVI
    slots = kivi_window_bytes(cc, mc, sc, dtype)[0] if sc is not None and device.type == "cuda" else 16
    return [PagedKIVI(num_blocks, cc.block_size, mc.num_key_value_heads, mc.head_dim, bits,
                      dtype, device, window_slots=slots) for _ in range(mc.num_hidden_layers)]


def bind_kv_cache(layers, pool: torch.Tensor, scales: torch.Tensor | None,
                  kivi: list | None = None) -> None:
    """Point each attention layer at its K/V views of the pool (and scales, or its
    KIVI blocks)."""
    for i, layer in enumerate(layers):
        layer.k_cache, layer.v_cache = pool[i, 0], pool[i, 1]
        layer.k_scale = layer.v_scale = None
        if scales is not None:
            layer.k_scale, layer.v_scale = scales[i, 0], scales[i, 1]
        layer.kivi = None if kivi is None else kivi[i]

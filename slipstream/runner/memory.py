"""Sizing and allocating the paged KV pool.

The pool is one tensor [num_layers, 2, num_blocks, block_size, num_kv_heads,
head_dim]; each attention layer gets views of its K and V halves.
"""
from __future__ import annotations

import torch

from slipstream.config import CacheConfig, ModelConfig, SchedulerConfig
from slipstream.errors import SlipstreamError

DEFAULT_CPU_KV_BYTES = 1 << 30


def kv_bytes_per_token(mc: ModelConfig, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * elem


def activation_reserve_bytes(mc: ModelConfig, sc: SchedulerConfig, dtype: torch.dtype) -> int:
    """A generous bound on the working memory of one step, kept out of the KV
    pool: hidden states and MLP intermediates of the token budget, plus fp32
    logits and sampling scratch for every running sequence."""
    elem = torch.empty((), dtype=dtype).element_size()
    t = sc.max_num_batched_tokens
    per_token = (4 * mc.hidden_size + 3 * mc.intermediate_size
                 + (mc.num_attention_heads + 2 * mc.num_key_value_heads) * mc.head_dim)
    return 2 * t * per_token * elem + 4 * sc.max_num_seqs * mc.vocab_size * 4


def num_kv_blocks(cc: CacheConfig, mc: ModelConfig, sc: SchedulerConfig,
                  dtype: torch.dtype, device: torch.device) -> int:
    per_block = kv_bytes_per_token(mc, dtype) * cc.block_size
    if cc.num_blocks is not None:
        n = cc.num_blocks
    elif device.type == "cuda":
        # Our share of the card minus what others use and what this process
        # holds live (weights, other engines); memory our allocator merely
        # keeps cached is still ours to hand out.
        free, total = torch.cuda.mem_get_info(device)
        others = total - free - torch.cuda.memory_reserved(device)
        budget = int(total * cc.gpu_memory_utilization) - others - torch.cuda.memory_allocated(device)
        n = (budget - activation_reserve_bytes(mc, sc, dtype)) // per_block
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
    # Zeroed so that a kernel reading a padded tile never meets NaN bit patterns.
    if device.type == "cpu":
        # calloc'd by numpy: the OS hands out zero pages as they are first touched, so
        # allocating costs no time and resident memory grows only with the tokens cached
        import numpy as np
        shape = (mc.num_hidden_layers, 2, num_blocks, cc.block_size, mc.num_key_value_heads, mc.head_dim)
        nbytes = kv_bytes_per_token(mc, dtype) * num_blocks * cc.block_size
        return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)
    return torch.zeros(mc.num_hidden_layers, 2, num_blocks, cc.block_size,
                       mc.num_key_value_heads, mc.head_dim, dtype=dtype, device=device)

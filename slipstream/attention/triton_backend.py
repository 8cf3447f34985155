"""The GPU attention backend: Triton kernels for every kind of step.

Per step (`prepare`) it picks one path from host-side metadata only:
  * tree verification (`batch.tree_mask` set): split-KV tree kernel;
  * decode only (every request brings one token): FlashDecoding split-KV kernel,
    with the split count chosen from the batch size and longest context (or
    fixed by `batch.decode_splits`, as a captured CUDA graph needs);
  * prompts and prompt chunks: on sm_90 the Gluon FlashAttention-3-style
    kernel (kernels/gluon_prefill.py), whole prompts from the step's K/V and
    prompts after cached context from the paged cache (SLIPSTREAM_GLUON_PREFILL=0
    turns it off; =fp8 sends whole prompts to its FP8 version, q / k / v
    quantised by kernels/fp8_quantize.py first); elsewhere, and where the Gluon
    kernel does not serve a layer, the FlashAttention-2 Triton prefill kernel;
  * mixed steps: the decode rows (first in the step) go to the split-KV kernel
    and the rest to the prefill kernel, each writing its part of the output.
Each layer first writes its new K/V into the paged cache (KV store kernel),
quantizing them when the cache holds int8 / fp8 codes (`layer.k_scale` set);
every kernel then reads the codes and scales directly. A KIVI cache
(`layer.kivi`): decode steps through kernels/kivi_decode.py, the others through
the torch backend's KIVI path (its window bookkeeping runs on the host, so such
steps read the step's slots from host copies and run without CUDA graphs). Given the step's rotary
(`rope`: the model leaves q and k unrotated when `fuses_rotary`), one kernel
rotates q and k in place and stores K/V (kernels/rotary_kv_store.py).
`forward` never reads device memory back, so it adds no host-device sync.
"""
from __future__ import annotations

import torch

from slipstream.attention.base import AttentionLayerInfo, register_backend
from slipstream.attention.torch_backend import kivi_attention
from slipstream.kernels.decode_attention import (
    MAX_TREE_NODES, choose_num_splits, split_kv_attention, split_kv_scratch)
from slipstream.kernels.fp8_quantize import quantize_fp8_inputs_fused
from slipstream.kernels.gluon_fp8_prefill import gluon_fp8_prefill, gluon_fp8_prefill_wanted
from slipstream.kernels.tree_attention import pack_tree_mask
from slipstream.kernels.gluon_prefill import gluon_prefill, gluon_prefill_paged, gluon_prefill_wanted
from slipstream.kernels.kivi_decode import kivi_decode_attention, supported as kivi_supported
from slipstream.kernels.kv_store import store_kv
from slipstream.kernels.rotary_kv_store import rotary_store_kv
from slipstream.kernels.prefill_attention import prefill_attention
from slipstream.batch import ForwardBatch


@register_backend("triton")
class TritonAttentionBackend:
    name = "triton"
    takes_tree_bits = True   # reads ForwardBatch.tree_bits instead of tree_mask when given
    # The model may hand q and k over unrotated, with the step's rotary (one kernel
    # rotates them and stores K/V); False keeps the separate rotary kernel.
    fuses_rotary = True

    def __init__(self) -> None:
        self._scratch: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def prepare(self, batch: ForwardBatch) -> None:
        if batch.tree_mask is not None:
            self._mode = "split_kv"
            if batch.max_query_len > MAX_TREE_NODES:
                raise ValueError(f"the triton backend verifies draft trees of at most "
                                 f"{MAX_TREE_NODES} nodes, got {batch.max_query_len}")
            self._tree_bits = (batch.tree_bits if batch.tree_bits is not None else
                               pack_tree_mask(batch.tree_mask[:, :, :batch.max_query_len]))
        elif batch.is_decode_only:
            self._mode = "split_kv"
            self._tree_bits = None
        elif batch.num_decode_seqs:
            self._mode = "mixed"
            self._tree_bits = None
            d = batch.num_decode_seqs
            # The prefill part as a batch of its own (offsets from its first token).
            self._prefill_loc = batch.query_start_loc[d:] - d
            # A copy, so the kernel always sees a 16-byte aligned base (no
            # alignment specialisation per decode count).
            self._prefill_ctx = batch.context_lens[d:].clone()
            self._prefill_max_q = max(batch.query_lens_cpu[d:])
            self._decode_max_len = max(batch.seq_lens_cpu[:d])
        else:
            self._mode = "prefill"
            self._tree_bits = None
        # Prompt tokens take the Gluon kernels on sm_90: whole prompts (no cached
        # context) with the step's own K/V, and prompts after cached context (prefix
        # hits, chunks) from the paged cache; a layer they do not serve (ValueError)
        # falls back to the portable kernel.
        wanted = self._mode != "decode" and gluon_prefill_wanted(batch.query_start_loc.device)
        whole = self._mode == "prefill" and batch.seq_lens_cpu == batch.query_lens_cpu
        self._gluon = wanted and whole
        self._gluon_paged = wanted and not whole
        self._gluon_fp8 = self._gluon and gluon_fp8_prefill_wanted()
        self._splits: dict[tuple[int, int], int] = {}  # per head shape, set by the first layer
        self._loc = None   # host request boundaries, for a KIVI cache's torch path

    def _num_splits(self, layer: AttentionLayerInfo, num_seqs: int, max_seq_len: int,
                    max_query_len: int, fixed: int | None) -> int:
        if fixed is not None:
            return fixed
        key = (layer.num_heads, layer.num_kv_heads)
        splits = self._splits.get(key)
        if splits is None:
            splits = choose_num_splits(num_seqs, layer.num_kv_heads, max_seq_len,
                                       max_query_len=max_query_len,
                                       group=layer.num_heads // layer.num_kv_heads)
            self._splits[key] = splits
        return splits

    def _scratch_for(self, q: torch.Tensor, splits: int):
        # One buffer pair per shape, reused by every layer and step of that shape,
        # and never freed: a captured CUDA graph keeps writing to the pair it saw.
        # Shapes are few: split steps have at most a few dozen tokens x splits.
        key = (q.shape[0], q.shape[1], splits, q.shape[2], q.device)
        buf = self._scratch.get(key)
        if buf is None:
            buf = self._scratch[key] = split_kv_scratch(q.shape[0], q.shape[1], splits, q.shape[2],
                                                        q.device)
        return buf

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                layer: AttentionLayerInfo, batch: ForwardBatch, rope=None,
                out: torch.Tensor | None = None) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim];
        # rope: the step's StepRotary (layers/rotary.py) when q and k are still unrotated;
        # out: where to write the result (q's shape, rows contiguous), or None.
        if getattr(layer, "kivi", None) is not None:
            return self._kivi(q, k, v, layer, batch, out)
        if rope is not None:  # q and k rotated in place, K/V stored: one kernel
            rotary_store_kv(q, k, v, rope.positions, rope.cos_table, rope.sin_table,
                            layer.k_cache, layer.v_cache, batch.slot_mapping, layer.k_scale,
                            layer.v_scale)
        else:
            store_kv(k, v, layer.k_cache, layer.v_cache, batch.slot_mapping, layer.k_scale,
                     layer.v_scale)
        if self._mode == "prefill":
            if self._gluon and layer.sliding_window is None:
                try:
                    if self._gluon_fp8:
                        x = quantize_fp8_inputs_fused(q, k, v, batch.query_start_loc, batch.max_query_len)
                        o = gluon_fp8_prefill(x, batch.query_start_loc, batch.max_query_len,
                                              layer.scale, out_dtype=q.dtype,
                                              lengths=batch.query_lens_cpu)
                    else:
                        o = gluon_prefill(q, k, v, batch.query_start_loc, batch.max_query_len,
                                          layer.scale, causal=True, lengths=batch.query_lens_cpu)
                    return o if out is None else out.copy_(o)   # the Gluon kernels allocate
                except ValueError:
                    self._gluon = False
            if self._gluon_paged:
                o = self._paged_gluon(q, layer, batch.query_start_loc, batch.seq_lens,
                                      batch.block_tables, batch.max_query_len, out)
                if o is not None:
                    return o
            return prefill_attention(
                q, k, v, layer.k_cache, layer.v_cache, batch.query_start_loc, batch.context_lens,
                batch.block_tables, batch.max_query_len, layer.scale,
                causal=True, sliding_window=layer.sliding_window, out=out,
                k_cache_scale=layer.k_scale, v_cache_scale=layer.v_scale)
        if self._mode == "mixed":
            d = batch.num_decode_seqs
            out = torch.empty_like(q) if out is None else out
            self._decode(q[:d], layer, batch.query_start_loc[:d + 1], batch.seq_lens[:d],
                         batch.block_tables[:d], d, self._decode_max_len, 1, None, out[:d])
            if self._gluon_paged and self._paged_gluon(
                    q[d:], layer, self._prefill_loc, batch.seq_lens[d:], batch.block_tables[d:],
                    self._prefill_max_q, out[d:]) is not None:
                return out
            prefill_attention(
                q[d:], k[d:], v[d:], layer.k_cache, layer.v_cache, self._prefill_loc,
                self._prefill_ctx, batch.block_tables[d:], self._prefill_max_q, layer.scale,
                causal=True, sliding_window=layer.sliding_window, out=out[d:],
                k_cache_scale=layer.k_scale, v_cache_scale=layer.v_scale)
            return out
        return self._decode(q, layer, batch.query_start_loc, batch.seq_lens, batch.block_tables,
                            batch.num_seqs, batch.max_seq_len, batch.max_query_len,
                            batch.decode_splits, out)

    def _kivi(self, q, k, v, layer, batch, out):
        """A KIVI cache (q and k arrive rotated): decode steps through the KIVI decode
        kernel, other steps through the torch backend's KIVI path."""
        store = layer.kivi
        if (self._mode != "split_kv" or self._tree_bits is not None
                or layer.sliding_window is not None or not kivi_supported(store, q)):
            if self._loc is None:
                self._loc = [0]
                for n in batch.query_lens_cpu:
                    self._loc.append(self._loc[-1] + n)
            o = kivi_attention(q, k, v, layer, batch, self._loc)
            return o if out is None else out.copy_(o)
        store.store(k, v, batch.slot_mapping, batch.slot_mapping_host)
        store.seal_many(batch.host_block_tables(), batch.seq_lens_cpu)
        return kivi_decode_attention(q, store, batch.seq_lens, batch.block_tables, layer.scale,
                                     max_seq_len=batch.max_seq_len, out=out)

    def _paged_gluon(self, q, layer, query_start_loc, seq_lens, block_tables, max_query_len,
                     out):
        """The prompt rows through the Gluon kernel over the paged cache (16-bit caches,
        no sliding window), into `out` (None: a new tensor); None where it does not
        serve them (the portable kernel does)."""
        if layer.sliding_window is not None or layer.k_scale is not None:
            return None
        try:
            return gluon_prefill_paged(q, layer.k_cache, layer.v_cache, query_start_loc, seq_lens,
                                       block_tables, max_query_len, layer.scale, causal=True,
                                       out=out)
        except ValueError:
            self._gluon_paged = False
            return None

    def _decode(self, q, layer, query_start_loc, seq_lens, block_tables, num_seqs, max_seq_len,
                max_query_len, fixed_splits, out):
        splits = self._num_splits(layer, num_seqs, max_seq_len, max_query_len, fixed_splits)
        scratch = self._scratch_for(q, splits) if splits > 1 else None
        return split_kv_attention(
            q, layer.k_cache, layer.v_cache, query_start_loc, seq_lens, block_tables,
            max_query_len, layer.scale, splits, sliding_window=layer.sliding_window,
            tree_bits=self._tree_bits, out=out, scratch=scratch, k_scale=layer.k_scale,
            v_scale=layer.v_scale, max_seq_len=max_seq_len)

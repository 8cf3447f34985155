"""The reference attention backend: plain PyTorch, runs on CPU and GPU.

Prefill and mixed batches go through `kernels.reference.paged_attention`, one
request at a time. Two cheap shortcuts keep the CPU decode path fast without
changing the math: a lone decode token needs no mask (it sees its whole
context), and a batch of decodes is gathered and attended in one SDPA call.
That call reads every slot of the requests' padded block tables; the masked
ones must hold finite values, which holds because the KV pool is allocated
zeroed and only ever written with finite K/V.

On the CPU, decode steps run `kernels.cpu_attention` instead when it is
built: it reads each request's blocks in place (no gather of the context, no
padded tables), and a prompt with nothing cached attends over its own K/V
without reading them back from the cache.

A quantized cache (int8 / fp8 codes, `layer.k_scale` set) takes the reference
path: K/V are quantized as they are stored, and every query token, a prompt's
included, attends to the dequantized cache, so the numerics are those of a
cache read back at every step. A KIVI cache (`layer.kivi`, cache/kivi_paged.py):
each request's cached context as the cache holds it (sealed blocks
dequantized, its window exact), and the step's own tokens exact; CPU decode
steps through the C decode attention, which reads the codes in place.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from slipstream.attention.base import AttentionLayerInfo, register_backend
from slipstream.kernels import cpu_attention, reference
from slipstream.batch import ForwardBatch


@register_backend("torch")
class TorchAttentionBackend:
    name = "torch"

    def prepare(self, batch: ForwardBatch) -> None:
        # Host copies of the request boundaries, computed once per step.
        loc = [0]
        for n in batch.query_lens_cpu:
            loc.append(loc[-1] + n)
        self._query_start_loc = loc
        self._decode_mask = None   # built by the first layer that needs it
        self._cpu_kernel = None    # whether cpu_attention serves this step (asked once)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                layer: AttentionLayerInfo, batch: ForwardBatch,
                out: torch.Tensor | None = None) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim];
        # out: where the result goes (a copy here), or None
        o = self._attend(q, k, v, layer, batch)
        return o if out is None else out.copy_(o)

    def _attend(self, q, k, v, layer: AttentionLayerInfo, batch: ForwardBatch) -> torch.Tensor:
        if getattr(layer, "kivi", None) is not None:
            return self._kivi(q, k, v, layer, batch)
        if layer.k_scale is not None:
            return self._quantized(q, k, v, layer, batch)
        if self._cpu_kernel is None:
            self._cpu_kernel = cpu_attention.supported(layer.k_cache, q.shape[-1])
        if batch.is_decode_only and batch.tree_mask is None and self._cpu_kernel:
            # stores this step's K/V and attends, in one call
            return cpu_attention.decode_attention(q, layer.k_cache, layer.v_cache, batch.seq_lens,
                                                  batch.block_tables, layer.scale, layer.sliding_window,
                                                  k, v, batch.slot_mapping)
        reference.store_kv(k, v, layer.k_cache, layer.v_cache, batch.slot_mapping)
        if (batch.num_seqs == 1 and batch.tree_mask is None and self._cpu_kernel
                and batch.seq_lens_cpu[0] == q.shape[0]):
            return self._fresh_prompt(q, k, v, layer)
        if batch.num_seqs > 1 and batch.tree_mask is None and self._cpu_kernel \
                and not batch.is_decode_only:
            return self._mixed(q, k, v, layer, batch)
        if batch.is_decode_only and batch.tree_mask is None:
            if batch.num_seqs > 1:
                return self._batched_decode(q, layer, batch)
            if layer.sliding_window is None:
                return self._single_decode(q, layer, batch)
        return reference.paged_attention(
            q, layer.k_cache, layer.v_cache, self._query_start_loc, batch.seq_lens_cpu,
            batch.block_tables, layer.scale, layer.sliding_window, batch.tree_mask)

    def _mixed(self, q, k, v, layer, batch) -> torch.Tensor:
        """A step with prompt tokens and several requests, each row as it would run
        alone: decode rows through the decode kernel (as in decode-only steps), a
        fresh prompt through `_fresh_prompt` (as a lone prompt), the rest (chunks
        after a cached prefix) through the paged reference. So what else is in the
        step does not change a request's attention."""
        loc, lens = self._query_start_loc, batch.seq_lens_cpu
        out = torch.empty_like(q)
        decode = [i for i in range(batch.num_seqs) if loc[i + 1] - loc[i] == 1]
        if decode:
            seqs = torch.tensor(decode)
            rows = torch.tensor([loc[i] for i in decode])
            out[rows] = cpu_attention.decode_attention(     # K/V are in the cache already
                q[rows], layer.k_cache, layer.v_cache, batch.seq_lens[seqs],
                batch.block_tables[seqs], layer.scale, layer.sliding_window)
        for i in range(batch.num_seqs):
            qs, qe = loc[i], loc[i + 1]
            if qe - qs <= 1:
                continue
            if lens[i] == qe - qs:
                out[qs:qe] = self._fresh_prompt(q[qs:qe], k[qs:qe], v[qs:qe], layer)
            else:
                out[qs:qe] = reference.paged_attention(
                    q[qs:qe], layer.k_cache, layer.v_cache, [0, qe - qs], [lens[i]],
                    batch.block_tables[i:i + 1], layer.scale, layer.sliding_window)
        return out

    def _quantized(self, q, k, v, layer, batch) -> torch.Tensor:
        reference.store_kv(k, v, layer.k_cache, layer.v_cache, batch.slot_mapping,
                           layer.k_scale, layer.v_scale)
        if batch.is_decode_only and batch.tree_mask is None and batch.num_seqs > 1:
            return self._batched_decode(q, layer, batch)
        return reference.paged_attention(
            q, layer.k_cache, layer.v_cache, self._query_start_loc, batch.seq_lens_cpu,
            batch.block_tables, layer.scale, layer.sliding_window, batch.tree_mask,
            layer.k_scale, layer.v_scale)

    def _kivi(self, q, k, v, layer, batch) -> torch.Tensor:
        return kivi_attention(q, k, v, layer, batch, self._query_start_loc)

    @staticmethod
    def _fresh_prompt(q, k, v, layer) -> torch.Tensor:
        # one prompt, nothing cached before it: causal attention over its own k, v
        n = q.shape[0]
        mask = None
        if layer.sliding_window is not None and n > layer.sliding_window:
            pos = torch.arange(n, device=q.device)
            d = pos[:, None] - pos[None, :]
            mask = (d >= 0) & (d < layer.sliding_window)
        # 4-D inputs: torch's CPU flash kernel takes [batch, heads, n, dim] (3-D ones
        # fall back to the math path, ~3x slower on a 512-token prompt)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1).to(q.dtype)[None], v.transpose(0, 1).to(q.dtype)[None],
            attn_mask=mask, is_causal=mask is None, scale=layer.scale,
            enable_gqa=layer.num_heads != layer.num_kv_heads)
        return o[0].transpose(0, 1)

    @staticmethod
    def _single_decode(q, layer, batch) -> torch.Tensor:
        n = batch.seq_lens_cpu[0]
        k = reference.gather_kv(layer.k_cache, batch.block_tables[0], n)   # [n, kv_heads, dim]
        v = reference.gather_kv(layer.v_cache, batch.block_tables[0], n)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale=layer.scale,
            enable_gqa=layer.num_heads != layer.num_kv_heads)
        return o.transpose(0, 1)                                             # [1, heads, dim]

    def _batched_decode(self, q, layer, batch) -> torch.Tensor:
        tables = batch.block_tables.long()
        b = tables.shape[0]
        # [b, blocks, block_size, kv_heads, dim] -> [b, kv_heads, padded_len, dim]
        k = layer.k_cache[tables]
        v = layer.v_cache[tables]
        if layer.k_scale is not None:   # codes x per-(token, head) scales, in q's dtype
            k = (k.float() * layer.k_scale[tables][..., None]).to(q.dtype)
            v = (v.float() * layer.v_scale[tables][..., None]).to(q.dtype)
        k = k.flatten(1, 2).transpose(1, 2)
        v = v.flatten(1, 2).transpose(1, 2)
        if self._decode_mask is None:
            # [b, 1, 1, padded_len]: each request sees its own tokens only.
            self._decode_keys = torch.arange(k.shape[2], device=k.device)
            self._decode_mask = (self._decode_keys < batch.seq_lens[:, None])[:, None, None, :]
        mask = self._decode_mask
        if layer.sliding_window is not None:
            lo = (batch.seq_lens - layer.sliding_window)[:, None, None, None]
            mask = mask & (self._decode_keys >= lo)
        o = F.scaled_dot_product_attention(
            q.view(b, 1, layer.num_heads, -1).transpose(1, 2), k, v, attn_mask=mask,
            scale=layer.scale, enable_gqa=layer.num_heads != layer.num_kv_heads)
        return o.transpose(1, 2).reshape(b, layer.num_heads, -1)


def kivi_attention(q, k, v, layer, batch: ForwardBatch, query_start_loc: list[int]) -> torch.Tensor:
    """Any step over a KIVI cache (`layer.kivi`), plain PyTorch: the step's K/V stored,
    each request's blocks that left its window sealed, then each request attends to
    its cached context as the cache holds it (sealed blocks dequantized, the window
    exact) and to the step's own tokens exact (as KIVI computes a prompt's attention
    before quantizing its cache). query_start_loc: the step's request boundaries."""
    store = layer.kivi
    tables = batch.host_block_tables()
    if (batch.is_decode_only and batch.tree_mask is None and q.device.type == "cpu"
            and cpu_attention.supported(store.win_k, q.shape[-1])):
        # the C decode attention: stores the step's rows in the window pool and reads
        # sealed blocks from their codes (after the blocks leaving the window are sealed)
        pool = torch.from_numpy(store.reserve(batch.slot_mapping, batch.slot_mapping_host))
        store.seal_many(tables, batch.seq_lens_cpu)
        return cpu_attention.decode_attention(
            q, store.win_k, store.win_v, batch.seq_lens, batch.block_tables, layer.scale,
            layer.sliding_window, k, v, pool, kivi=cpu_attention.kivi_struct(store))
    store.store(k, v, batch.slot_mapping, batch.slot_mapping_host)
    out = torch.empty_like(q)
    loc = query_start_loc
    for i, seq_len in enumerate(batch.seq_lens_cpu):
        qs, qe = loc[i], loc[i + 1]
        if qe == qs:
            continue
        c = seq_len - (qe - qs)
        store.seal(tables[i], seq_len)
        kk, vv = store.read(tables[i], c)
        kk, vv = torch.cat([kk, k[qs:qe].float()]), torch.cat([vv, v[qs:qe].float()])
        mask = reference.attention_mask(qe - qs, seq_len, q.device, layer.sliding_window,
                                        None if batch.tree_mask is None else batch.tree_mask[i])
        o = F.scaled_dot_product_attention(
            q[qs:qe].transpose(0, 1), kk.to(q.dtype).transpose(0, 1),
            vv.to(q.dtype).transpose(0, 1), attn_mask=mask, scale=layer.scale,
            enable_gqa=layer.num_heads != layer.num_kv_heads)
        out[qs:qe] = o.transpose(0, 1)
    return out

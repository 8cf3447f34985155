"""Plain-PyTorch twins of the Triton kernels (attention, KV store, fused ops).

These are the ground truth the Triton kernels are tested against, and the
torch attention backend runs on them, so they favour clarity over speed.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """Write new keys/values into the paged cache.

    k, v: [num_tokens, num_kv_heads, head_dim]
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: [num_tokens] int64, block * block_size + offset; -1 skips a token
    k_scale, v_scale: [num_blocks, block_size, num_kv_heads] fp32 for a quantized
    cache (int8 / fp8 codes, quant/kv_quant.py): each token is quantized per head.
    """
    num_blocks, block_size = k_cache.shape[:2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        flat = cache.view(num_blocks * block_size, *cache.shape[2:])
        if scale is None:
            flat[slots] = x[keep].to(cache.dtype)
        else:
            from slipstream.quant.kv_quant import kv_format_of
            codes, s = kv_format_of(cache.dtype).quantize(x[keep])
            flat[slots] = codes
            scale.view(num_blocks * block_size, scale.shape[2])[slots] = s


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int,
              scale: torch.Tensor | None = None) -> torch.Tensor:
    """The first `length` tokens of one request: [length, num_kv_heads, head_dim]
    (dequantized to fp32 when `scale` [num_blocks, block_size, num_kv_heads] is given)."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    blocks = block_table[:num_blocks].long()
    x = cache[blocks].flatten(0, 1)[:length]
    if scale is None:
        return x
    return x.float() * scale[blocks].flatten(0, 1)[:length, :, None]


def attention_mask(query_len: int, seq_len: int, device: torch.device,
                   sliding_window: int | None = None,
                   tree_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Which keys each query token may see: [query_len, seq_len] bool.

    Query token t sits at position ctx + t (ctx = seq_len - query_len). It sees
    every cached key, the step's keys up to itself (or its tree ancestors when
    `tree_mask` [query_len, query_len] is given), and with a sliding window only
    keys j with pos - j < sliding_window.
    """
    ctx = seq_len - query_len
    q_pos = torch.arange(ctx, seq_len, device=device)[:, None]
    k_pos = torch.arange(seq_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if tree_mask is not None:
        mask = mask.clone()
        mask[:, ctx:] = tree_mask[:query_len, :query_len].to(torch.bool)
    if sliding_window is not None:
        mask &= (q_pos - k_pos) < sliding_window
    return mask


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    query_start_loc: list[int], seq_lens: list[int], block_tables: torch.Tensor,
                    scale: float, sliding_window: int | None = None,
                    tree_mask: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Variable-length attention over a paged KV cache (prefill, chunked prefill,
    decode and tree verification are all this one function).

    q: [num_tokens, num_heads, head_dim]; the new K/V must already be in the cache.
    query_start_loc: num_seqs + 1 host ints; seq_lens: num_seqs host ints.
    block_tables: [num_seqs, max_blocks] int32.
    tree_mask: optional [num_seqs, max_query_len, max_query_len] bool.
    k_scale, v_scale: the per-(slot, head) scales of a quantized cache, else None.
    returns [num_tokens, num_heads, head_dim] in q's dtype.
    """
    out = torch.empty_like(q)
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    for i, seq_len in enumerate(seq_lens):
        qs, qe = query_start_loc[i], query_start_loc[i + 1]
        if qe == qs:
            continue
        k = gather_kv(k_cache, block_tables[i], seq_len, k_scale).to(q.dtype)
        v = gather_kv(v_cache, block_tables[i], seq_len, v_scale).to(q.dtype)
        mask = attention_mask(qe - qs, seq_len, q.device, sliding_window,
                              None if tree_mask is None else tree_mask[i])
        o = F.scaled_dot_product_attention(
            q[qs:qe].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
            attn_mask=mask, scale=scale, enable_gqa=num_heads != num_kv_heads)
        out[qs:qe] = o.transpose(0, 1)
    return out


def prefill_attention(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                      k_cache: torch.Tensor, v_cache: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                      block_tables: torch.Tensor, scale: float, causal: bool = True,
                      sliding_window: int | None = None, k_cache_scale: torch.Tensor | None = None,
                      v_cache_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Twin of `kernels.prefill_attention`: each request's cached context comes
    from the paged cache (dequantized with the cache scales, if any) and its step
    tokens' K/V from `k`/`v` at full precision (from the cache too when `k` is
    None). Non-causal attention sees every key."""
    loc = cu_seqlens_q.tolist()
    ctx = context_lens.tolist()
    out = torch.empty(q.shape, dtype=(v if v is not None else q).dtype, device=q.device)
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    for i, c in enumerate(ctx):
        qs, qe = loc[i], loc[i + 1]
        n = qe - qs
        if n == 0:
            continue
        if k is None:
            kk = gather_kv(k_cache, block_tables[i], c + n, k_cache_scale).to(q.dtype)
            vv = gather_kv(v_cache, block_tables[i], c + n, v_cache_scale).to(q.dtype)
        else:
            kk = torch.cat([gather_kv(k_cache, block_tables[i], c, k_cache_scale).to(q.dtype),
                            k[qs:qe].to(q.dtype)])
            vv = torch.cat([gather_kv(v_cache, block_tables[i], c, v_cache_scale).to(q.dtype),
                            v[qs:qe].to(q.dtype)])
        if causal:
            mask = attention_mask(n, c + n, q.device, sliding_window)
        else:
            mask = torch.ones(n, c + n, dtype=torch.bool, device=q.device)
        o = F.scaled_dot_product_attention(
            q[qs:qe].transpose(0, 1), kk.transpose(0, 1), vv.transpose(0, 1),
            attn_mask=mask, scale=scale, enable_gqa=num_heads != num_kv_heads)
        out[qs:qe] = o.transpose(0, 1)
    return out


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                     sliding_window: int | None = None, k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Twin of `kernels.decode_attention`: q [num_seqs, num_heads, head_dim], one
    token per request, at position seq_lens[i] - 1 (its K/V already stored)."""
    return paged_attention(q, k_cache, v_cache, list(range(q.shape[0] + 1)), seq_lens.tolist(),
                           block_tables, scale, sliding_window, None, k_scale, v_scale)


def tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                   tree_mask: torch.Tensor, scale: float,
                   sliding_window: int | None = None, k_scale: torch.Tensor | None = None,
                   v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Twin of `kernels.tree_attention`: each request's query tokens (a draft
    tree, already stored in the cache after its context) see the context and
    the tokens `tree_mask[i]` [max_q, max_q] allows."""
    return paged_attention(q, k_cache, v_cache, cu_seqlens_q.tolist(), seq_lens.tolist(),
                           block_tables, scale, sliding_window, tree_mask, k_scale, v_scale)


def fp8_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          cu_seqlens_q: torch.Tensor, scale: float, rotation: torch.Tensor | None,
                          quant_block: int, causal: bool = True) -> torch.Tensor:
    """Twin of `kernels.fp8_attention.fp8_prefill_attention`: the same rotation
    and block quantisation of q and k, dequantised, then exact attention in fp32
    (no context: the FP8 path serves whole prompts)."""
    from slipstream.kernels.fp8_attention import quantize_fp8_blocks
    if rotation is not None:
        q, k = q.float() @ rotation, k.float() @ rotation
    q8, qs = quantize_fp8_blocks(q, cu_seqlens_q, quant_block)
    k8, ks = quantize_fp8_blocks(k, cu_seqlens_q, quant_block)
    qd = q8.float() * qs[..., None]
    kd = k8.float() * ks[..., None]
    no_cache = torch.zeros(1, 1, k.shape[1], k.shape[2], dtype=torch.float32, device=q.device)
    num_seqs = cu_seqlens_q.shape[0] - 1
    zeros = torch.zeros(num_seqs, dtype=torch.int32, device=q.device)
    tables = torch.zeros(num_seqs, 1, dtype=torch.int32, device=q.device)
    return prefill_attention(qd, kd, v.float(), no_cache, no_cache, cu_seqlens_q, zeros, tables,
                             scale, causal).to(v.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Twin of `kernels.rms_norm`, Hugging Face's LlamaRMSNorm: x [num_tokens, hidden]
    (plus `residual`, added first in the model dtype) normalised in fp32, cast to
    the model dtype, then scaled by `weight`. Returns normed, or (normed, x + residual)."""
    if residual is not None:
        x = x + residual
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(x.dtype)
    return out if residual is None else (out, x)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Twin of `kernels.silu_mul`: x [num_tokens, 2 * d] = [gate | up] -> [num_tokens, d]."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def rotary_inplace(qk: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor) -> torch.Tensor:
    """Twin of `kernels.rotary`: rotate qk [num_tokens, heads, head_dim] in place by
    the tables cos = [c | c], sin = [-s | s] ([max_position, head_dim]) at `positions`."""
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    half = qk.shape[-1] // 2
    swapped = torch.cat((qk[..., half:], qk[..., :half]), dim=-1)
    qk.copy_(torch.addcmul(qk * c, swapped, s))
    return qk


def rotary_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                    cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                    k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> None:
    """Twin of `kernels.rotary_kv_store`: rotate q and k in place, then store the
    rotated k and v in the paged cache (`store_kv`)."""
    rotary_inplace(q, positions, cos, sin)
    rotary_inplace(k, positions, cos, sin)
    store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


# ---- quantized linear layers (twins of kernels/quant_gemm.py, kernels/w8a8_gemm.py) ---

def int_weight_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                      qzeros: torch.Tensor | None, bits: int, group_cols: int) -> torch.Tensor:
    """Weight-only integer linear: y = x @ ((codes - zero) * scale)^T in x's dtype.

    x: [m, k]; qweight: uint8 [n, packed k] (pack_codes layout); scales: [n, ceil(k / group_cols)];
    qzeros: uint8 [n, ceil(k / group_cols)], or None for symmetric (zero = 2^(bits-1)).
    """
    from slipstream.quant.primitives import dequantize_codes, unpack_codes
    codes = unpack_codes(qweight, bits)
    zero = qzeros.float() if qzeros is not None else torch.full_like(scales, 2.0 ** (bits - 1))
    w = dequantize_codes(codes, scales.float(), zero.float(), group_cols)   # [n, k] fp32
    return F.linear(x, w.to(x.dtype))


def w8a8_linear(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor,
                w_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Twin of `kernels.w8a8_gemm`: int8 x int8 -> int32 accumulation (or float8 e4m3
    products, exact in fp64), then per-token x per-channel scales.

    xq: int8 or float8_e4m3fn [m, k]; x_scale: [m, 1]; wq: [n, k] like xq; w_scale: [n]
    -> [m, n] out_dtype."""
    # fp64 sums of int8 products are exact while |sum| < 2^53 (k < 5e11); CUDA has no
    # int64 matmul. An e4m3 product has at most 8 significant bits: fp64 sums of them
    # round far below the fp32 accumulator's error.
    acc = xq.double() @ wq.double().t()
    return (acc * x_scale.double() * w_scale.double()[None, :]).to(out_dtype)


# ---- per-token activation quantization (twins of kernels/quant_act.py and the
# ---- quantizing variants of kernels/rms_norm.py and kernels/silu_mul.py) ----------

def quantize_rows(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin of `kernels.quant_act.quantize_rows`: x [m, k] -> (int8 / float8_e4m3fn codes,
    scale [m, 1] fp32), symmetric per row."""
    from slipstream.quant.primitives import quantize_fp8_rows, quantize_int8_rows
    if kind not in ("int8", "fp8"):
        raise ValueError(f"kind: expected 'int8' or 'fp8', got {kind!r}")
    return (quantize_int8_rows if kind == "int8" else quantize_fp8_rows)(x)


def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None, kind: str):
    """Twin of `kernels.rms_norm(..., quant=kind)`: the normed rows (in the model dtype)
    quantized per token. Returns (codes, scale), or ((codes, scale), x + residual)."""
    out = rms_norm(x, weight, eps, residual)
    if residual is None:
        return quantize_rows(out, kind)
    return quantize_rows(out[0], kind), out[1]


def silu_and_mul_quant(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin of `kernels.silu_mul.silu_and_mul_quant`: silu(gate) * up (in the model dtype)
    quantized per token -> (codes [num_tokens, d], scale [num_tokens, 1])."""
    return quantize_rows(silu_and_mul(x), kind)


def all_reduce_rms_norm(partials: list[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin of `kernels.all_reduce_norm`: the ranks' partial rows summed in fp32 and
    rounded to the residual's dtype (as an all-reduce then `.to(dtype)`), then
    `rms_norm` with the residual. Returns (normed, sum + residual)."""
    s = partials[0].float()
    for p in partials[1:]:
        s = s + p.float()
    return rms_norm(s.to(residual.dtype), weight, eps, residual)

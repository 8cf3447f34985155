"""Attention ops of one layer: which keys each new token sees, and what that costs.

Causal attention of a new token at (0-based) position p looks at p + 1 keys,
fewer on windowed layers. FLOPs count only the query-key pairs that exist (a
FlashAttention kernel skips masked tiles), so prefilling N tokens costs
N (N + 1) / 2 pairs, not N^2.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np

from slipstream.analysis.model_spec import ModelSpec
from slipstream.analysis.op_cost import OpCost, matmul


@dataclass(frozen=True)
class Span:
    """What one sequence's attention covers on one layer in one step."""
    pairs: int        # query-key pairs computed
    keys_read: int    # distinct cached positions read


@lru_cache(maxsize=4096)
def span(past: int, new: int, window: int | None, kind: str) -> Span:
    """Keys of positions past..past+new-1; the new tokens' own K/V are written
    to the cache first and read back, as paged kernels do."""
    pos = np.arange(past, past + new, dtype=np.int64)
    if window is None:
        seen, first = pos + 1, 0
    elif kind == "sliding":
        seen, first = np.minimum(pos + 1, window), max(past - (window - 1), 0)
    else:  # chunked: a token sees only the earlier tokens of its own chunk
        seen, first = pos % window + 1, past - past % window
    return Span(int(seen.sum()), past + new - first)


@dataclass(frozen=True)
class AttentionInputs:
    """Everything the attention ops of one layer need to know about the step."""
    tokens: int            # new tokens in the step (batch x new per sequence)
    batch: int
    span: Span             # per sequence
    act: float             # bytes per activation element
    weight: float          # bytes per weight element (quantized linear layers)
    kv: float              # bytes per cached element


def gqa_ops(spec: ModelSpec, x: AttentionInputs) -> list[OpCost]:
    h, kv, hd, d = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.hidden_size
    t, pairs, keys = x.tokens, x.batch * x.span.pairs, x.batch * x.span.keys_read
    kv_half = keys * kv * hd * x.kv     # K (or V) of every read position
    return [
        matmul("qkv_proj", t, d, (h + 2 * kv) * hd, x.weight, x.act, bias=spec.attention_bias,
               out_written=h * hd, kv_write_bytes=t * 2 * kv * hd * x.kv),
        OpCost("attn_score", flops=2.0 * pairs * h * hd, act_bytes=t * h * hd * x.act,
               kv_read_bytes=kv_half),
        OpCost("attn_value", flops=2.0 * pairs * h * hd, act_bytes=t * h * hd * x.act,
               kv_read_bytes=kv_half),
        matmul("o_proj", t, h * hd, d, x.weight, x.act),
    ]


def _mla_projections(spec: ModelSpec, x: AttentionInputs) -> list[OpCost]:
    m, h, d, t = spec.mla, spec.num_heads, spec.hidden_size, x.tokens
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    if m.q_lora_rank:
        q_down = matmul("q_proj", t, d, m.q_lora_rank, x.weight, x.act)
        q = q_down + matmul("q_proj", t, m.q_lora_rank, h * qk, x.weight, x.act)
    else:
        q = matmul("q_proj", t, d, h * qk, x.weight, x.act)
    latent = m.kv_lora_rank + m.qk_rope_head_dim
    kv_a = matmul("kv_a_proj", t, d, latent, x.weight, x.act, out_written=0,
                  kv_write_bytes=t * latent * x.kv)
    return [q, kv_a]


def mla_absorbed_ops(spec: ModelSpec, x: AttentionInputs) -> list[OpCost]:
    """Decode form: W_UK is folded into the query and W_UV applied after
    attention, so attention runs over the cached latent itself (FlashMLA)."""
    m, h, t = spec.mla, spec.num_heads, x.tokens
    c, rope = m.kv_lora_rank, m.qk_rope_head_dim
    pairs, keys = x.batch * x.span.pairs, x.batch * x.span.keys_read
    return _mla_projections(spec, x) + [
        # q_nope [t, h, nope] x W_UK [h, nope, c]: the K half of kv_b_proj
        matmul("absorb_k", t * h, m.qk_nope_head_dim, c, x.weight, x.act, copies=h,
               copies_read=h, copies_active=h),
        # QK^T and softmax.V in one op: the latent tile read for the scores is
        # the V operand too, so the cache is read once for both.
        OpCost("attn_latent", flops=2.0 * pairs * h * (2 * c + rope),
               act_bytes=t * h * (2 * c + rope) * x.act, kv_read_bytes=keys * (c + rope) * x.kv),
        # [t, h, c] x W_UV [h, c, v]: the V half of kv_b_proj
        matmul("absorb_v", t * h, c, m.v_head_dim, x.weight, x.act, copies=h, copies_read=h,
               copies_active=h),
        matmul("o_proj", t, h * m.v_head_dim, spec.hidden_size, x.weight, x.act),
    ]


def mla_expanded_ops(spec: ModelSpec, x: AttentionInputs) -> list[OpCost]:
    """Prefill form: kv_b_proj expands the latent of every key into per-head
    K_nope and V, then ordinary attention with 192-wide keys runs."""
    m, h, t = spec.mla, spec.num_heads, x.tokens
    c, rope, nope, v = m.kv_lora_rank, m.qk_rope_head_dim, m.qk_nope_head_dim, m.v_head_dim
    pairs, keys = x.batch * x.span.pairs, x.batch * x.span.keys_read
    kv_b = matmul("kv_b_proj", keys, c, h * (nope + v), x.weight, x.act)
    # Its input is the cached latent, read from the KV cache, not an activation.
    kv_b = replace(kv_b, act_bytes=keys * h * (nope + v) * x.act,
                   kv_read_bytes=keys * (c + rope) * x.kv)
    return _mla_projections(spec, x) + [
        kv_b,
        # Q of the new tokens; K_nope per head plus the rope key shared by all heads.
        OpCost("attn_score", flops=2.0 * pairs * h * (nope + rope),
               act_bytes=(t * h * (nope + rope) + keys * (h * nope + rope)) * x.act),
        OpCost("attn_value", flops=2.0 * pairs * h * v, act_bytes=(keys + t) * h * v * x.act),
        matmul("o_proj", t, h * v, spec.hidden_size, x.weight, x.act),
    ]


def attention_ops(spec: ModelSpec, x: AttentionInputs) -> list[OpCost]:
    """MLA runs in whichever form needs fewer FLOPs for this step: absorbed for
    decode and short chunks, expanded for long prefills, as serving engines do."""
    if spec.mla is None:
        return gqa_ops(spec, x)
    forms = (mla_absorbed_ops(spec, x), mla_expanded_ops(spec, x))
    return min(forms, key=lambda ops: sum(op.flops for op in ops))

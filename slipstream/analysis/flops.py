"""Cost model of a whole forward pass: per layer and per op, FLOPs and minimal bytes.

One pass ("step") is described by a `Workload`: `batch` sequences each adding
`new_tokens` tokens after `past_tokens` already cached. Prefill of N tokens is
(1, N, 0); one decode step at batch B with context L is (B, 1, L - 1): the
new token attends to L keys, itself included.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from slipstream.analysis.attention_cost import AttentionInputs, attention_ops, span
from slipstream.analysis.model_spec import ModelSpec
from slipstream.analysis.op_cost import OpCost, elementwise, matmul, total
from slipstream.analysis.precision import BF16, Precision, parse_precision

# RMSNorm: square, sum, scale by 1/rms, multiply by the weight.
_NORM_FLOPS_PER_ELEMENT = 4


@dataclass(frozen=True)
class Workload:
    batch: int = 1
    new_tokens: int = 1
    past_tokens: int = 0
    all_logits: bool = False   # logits at every new position (speculative verification)

    def __post_init__(self):
        if self.batch < 1 or self.new_tokens < 1 or self.past_tokens < 0:
            raise ValueError(f"invalid workload {self}")

    @classmethod
    def prefill(cls, tokens: int, batch: int = 1) -> "Workload":
        return cls(batch, tokens, 0)

    @classmethod
    def decode(cls, batch: int = 1, context: int = 1) -> "Workload":
        if context < 1:
            raise ValueError(f"context must be >= 1, got {context}")
        return cls(batch, 1, context - 1)

    @property
    def tokens(self) -> int:
        return self.batch * self.new_tokens

    @property
    def logit_rows(self) -> int:
        # Generation needs the next-token distribution only at the last position.
        return self.tokens if self.all_logits else self.batch


@dataclass(frozen=True)
class Precisions:
    weight: Precision = BF16   # linear layers of the blocks, experts included
    kv: Precision = BF16       # KV cache
    act: Precision = BF16      # activations; embeddings, LM head, norms and routers stay here
    head: Precision | None = None   # an untied LM head quantized on its own; None: act
    head_when_tied: bool = False    # `head` holds for a tied head too (GGUF blocks serve both)

    @classmethod
    def parse(cls, weight="bf16", kv="bf16", act="bf16", head=None) -> "Precisions":
        return cls(parse_precision(weight), parse_precision(kv), parse_precision(act),
                   None if head is None else parse_precision(head))


@dataclass(frozen=True)
class ModelCost:
    spec: ModelSpec
    workload: Workload
    precisions: Precisions
    layers: tuple[tuple[OpCost, ...], ...]   # ops of layer 0, 1, ...
    head: tuple[OpCost, ...]                 # embedding, final norm, LM head

    def ops(self) -> list[OpCost]:
        return [op for layer in self.layers for op in layer] + list(self.head)

    def by_name(self) -> list[OpCost]:
        """Ops of the same name summed over layers, in order of first appearance."""
        acc: dict[str, OpCost] = {}
        for op in self.ops():
            acc[op.name] = acc[op.name] + op if op.name in acc else op
        return list(acc.values())

    def total(self) -> OpCost:
        return total(self.ops())


def distinct_experts(num_experts: int, per_token: int, tokens: int) -> float:
    """Expected experts touched by `tokens` independent, uniformly routed tokens:
    each expert is missed by one token with probability 1 - k / E."""
    return num_experts * (1.0 - (1.0 - per_token / num_experts) ** tokens)


def _mlp_ops(prefix: str, t: int, d: int, width: int, w: float, a: float) -> list[OpCost]:
    return [matmul(f"{prefix}gate_up_proj", t, d, 2 * width, w, a, out_written=width),
            matmul(f"{prefix}down_proj", t, width, d, w, a)]


def _moe_ops(spec: ModelSpec, t: int, w: float, a: float) -> list[OpCost]:
    moe, d = spec.moe, spec.hidden_size
    e, k, width = moe.num_experts, moe.experts_per_token, moe.expert_intermediate_size
    touched = distinct_experts(e, k, t)
    experts = dict(copies=e, copies_read=touched, copies_active=k)
    ops = [
        matmul("router", t, d, e, a, a),
        matmul("experts_gate_up_proj", t * k, d, 2 * width, w, a, out_written=width, **experts),
        matmul("experts_down_proj", t * k, width, d, w, a, **experts),
    ]
    if moe.num_shared_experts:
        ops += _mlp_ops("shared_", t, d, moe.shared_width, w, a)
    return ops


def _norm_op(spec: ModelSpec, t: int, a: float) -> OpCost:
    d = spec.hidden_size
    extra = 2 * spec.head_dim if spec.qk_norm else 0
    if spec.mla is not None:   # norms on the compressed q and kv latents
        extra += spec.mla.kv_lora_rank + (spec.mla.q_lora_rank or 0)
    return elementwise("norm", t, d, a, _NORM_FLOPS_PER_ELEMENT, passes=spec.norms_per_layer,
                       weights=spec.norms_per_layer * d + extra, weight_elem_bytes=a)


def layer_ops(spec: ModelSpec, layer: int, work: Workload, prec: Precisions) -> list[OpCost]:
    t, w, a = work.tokens, prec.weight.bytes_per_element, prec.act.bytes_per_element
    seq_span = span(work.past_tokens, work.new_tokens, spec.layer_window(layer), spec.window_kind)
    attn = attention_ops(spec, AttentionInputs(t, work.batch, seq_span, a, w,
                                               prec.kv.bytes_per_element))
    ffn = _moe_ops(spec, t, w, a) if spec.is_moe_layer(layer) else \
        _mlp_ops("", t, spec.hidden_size, spec.intermediate_size, w, a)
    return [_norm_op(spec, t, a)] + attn + ffn


def head_ops(spec: ModelSpec, work: Workload, prec: Precisions) -> list[OpCost]:
    d, v, a, rows = spec.hidden_size, spec.vocab_size, prec.act.bytes_per_element, work.logit_rows
    # The lookup reads one row per token; its FLOPs are nil.
    embed = OpCost("embed", weight_bytes=min(work.tokens, v) * d * a, act_bytes=work.tokens * d * a,
                   params=v * d, active_params=v * d, stored_bytes=v * d * a)
    tied = spec.tie_word_embeddings and not prec.head_when_tied
    head_w = a if prec.head is None or tied else prec.head.bytes_per_element
    lm_head = matmul("lm_head", rows, d, v, head_w, a)
    if spec.tie_word_embeddings:   # same matrix as the embedding: count its parameters once
        lm_head = replace(lm_head, params=0.0, active_params=0.0, stored_bytes=0.0)
    norm = elementwise("final_norm", rows, d, a, _NORM_FLOPS_PER_ELEMENT, weights=d,
                       weight_elem_bytes=a)
    return [embed, norm, lm_head]


def model_cost(spec: ModelSpec, work: Workload, prec: Precisions = Precisions()) -> ModelCost:
    layers = tuple(tuple(layer_ops(spec, i, work, prec)) for i in range(spec.num_layers))
    return ModelCost(spec, work, prec, layers, tuple(head_ops(spec, work, prec)))


@dataclass(frozen=True)
class ParamCounts:
    total: float
    active: float          # per token: routed experts counted k of E times; embedding included
    embedding: float       # the input embedding matrix (also the LM head when tied)
    tied: bool
    per_layer: tuple[float, ...]

    @property
    def matmul_active(self) -> float:
        """Active weights a token is multiplied by: all but the embedding lookup,
        unless the LM head multiplies by that same matrix."""
        return self.active if self.tied else self.active - self.embedding


def count_params(spec: ModelSpec) -> ParamCounts:
    cost = model_cost(spec, Workload())
    per_layer = tuple(sum(op.params for op in layer) for layer in cost.layers)
    everything = cost.total()
    return ParamCounts(everything.params, everything.active_params,
                       spec.vocab_size * spec.hidden_size, spec.tie_word_embeddings, per_layer)

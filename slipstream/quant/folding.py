"""Where a per-input-channel scale of a linear layer can be folded away (AWQ, SmoothQuant).

Both methods rewrite x W^T = (x diag(s)^-1) (W diag(s))^T and fold the division of x into
the operation that produces x, so the rewritten model costs nothing extra and computes
exactly what the original computes before rounding. In a Llama decoder layer:

    qkv_proj      x = RMSNorm(h) * g        -> g /= s             (input_layernorm)
    gate_up_proj  x = RMSNorm(h) * g        -> g /= s             (post_attention_layernorm)
    down_proj     x = silu(gate) * up       -> up's rows /= s     (shard 1 of gate_up_proj)
    o_proj        x = attention(q, k, v)    -> v's rows /= s      (shard 2 of qkv_proj)

Attention mixes positions, never channels, so value channel c reaches o_proj input channel
h * head_dim + d for every query head h sharing that value head (GQA): the scale must be
one per value channel. `Site.tie_reduce` maps a per-o_proj-input statistic to the value
channels (max or mean over the heads of a group) and `tie_expand` maps scales back.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class Site:
    name: str                  # the consumer's module name within the layer ("mlp.down_proj")
    consumer: nn.Module        # the linear layer whose input columns are scaled
    kind: str                  # "norm": divide a norm weight; "rows": divide producer rows
    producer: nn.Module        # the RMSNorm, or the fused linear holding the rows
    shard: int | None = None   # rows: which output shard of the producer
    heads: int = 1             # o_proj: query heads per value head (GQA group), head_dim
    head_dim: int = 0

    def tie_reduce(self, v: torch.Tensor, op: str) -> torch.Tensor:
        """[in] per consumer input channel -> [in] equal within each GQA group (max/mean)."""
        if self.heads == 1:
            return v
        g = v.view(-1, self.heads, self.head_dim)
        r = g.amax(1) if op == "max" else g.mean(1)
        return r[:, None, :].expand_as(g).reshape(-1)


def layer_sites(layer: nn.Module) -> list[Site]:
    """The four fold sites of a decoder layer, in the order the layer computes them."""
    attn, mlp = layer.self_attn, layer.mlp
    group = attn.num_heads // attn.num_kv_heads
    return [Site("self_attn.qkv_proj", attn.qkv_proj, "norm", layer.input_layernorm),
            Site("self_attn.o_proj", attn.o_proj, "rows", attn.qkv_proj, 2, group,
                 attn.head_dim),
            Site("mlp.gate_up_proj", mlp.gate_up_proj, "norm", layer.post_attention_layernorm),
            Site("mlp.down_proj", mlp.down_proj, "rows", mlp.gate_up_proj, 1)]


def _producer_rows(site: Site) -> tuple[torch.Tensor, torch.Tensor | None]:
    prod = site.producer
    off = sum(prod.output_sizes[:site.shard])
    n = prod.output_sizes[site.shard]
    bias = None if prod.bias is None else prod.bias.data[off:off + n]
    return prod.weight.data[off:off + n], bias


@torch.no_grad()
def fold(site: Site, s: torch.Tensor) -> None:
    """In place: the consumer's columns *= s, the producer's output /= s (s [in] > 0, tied
    within GQA groups for o_proj)."""
    site.consumer.weight.data.mul_(s.to(site.consumer.weight.dtype)[None, :])
    if site.kind == "norm":
        site.producer.weight.data.div_(s.to(site.producer.weight.dtype))
        return
    rows, bias = _producer_rows(site)
    if site.heads > 1:   # one scale per value channel: any head of its group carries it
        s = s.view(-1, site.heads, site.head_dim)[:, 0, :].reshape(-1)
    rows.div_(s.to(rows.dtype)[:, None])
    if bias is not None:
        bias.div_(s.to(bias.dtype))

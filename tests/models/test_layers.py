"""Layer building blocks against their Hugging Face counterparts."""
from __future__ import annotations

import pytest
import torch

from slipstream.config import RopeScaling
from slipstream.layers.linear import MergedLinear, QKVLinear
from slipstream.layers.norm import RMSNorm
from slipstream.layers.rotary import RotaryEmbedding, apply_rotary, rope_inv_freq


@pytest.mark.parametrize("scaling", [
    None,
    RopeScaling("linear", factor=4.0),
    RopeScaling("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=8192),
])
def test_inv_freq_matches_hf(scaling):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    rope = {"rope_type": "default", "rope_theta": 500000.0}
    if scaling is not None:
        rope = {**rope, "rope_type": scaling.rope_type, "factor": scaling.factor,
                "low_freq_factor": scaling.low_freq_factor,
                "high_freq_factor": scaling.high_freq_factor,
                "original_max_position_embeddings": scaling.original_max_position_embeddings}
    cfg = LlamaConfig(hidden_size=1024, num_attention_heads=8, rope_parameters=rope,
                      max_position_embeddings=131072)
    if scaling is None:
        ref, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(cfg)
    else:
        ref, _ = ROPE_INIT_FUNCTIONS[scaling.rope_type](cfg)
    torch.testing.assert_close(rope_inv_freq(128, 500000.0, scaling), ref, rtol=1e-6, atol=0)


def test_rotary_matches_rotate_half():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    rope = RotaryEmbedding(head_dim=32, max_position=100, base=10000.0)
    positions = torch.tensor([0, 5, 99, 42])
    q, k = torch.randn(4, 6, 32), torch.randn(4, 2, 32)
    cos, sin = rope.lookup(positions)
    inv = rope_inv_freq(32, 10000.0, None)
    ang = positions[:, None].float() * inv
    hf_cos, hf_sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    # HF layout [batch, heads, seq, dim]; ours [tokens, heads, dim]
    rq, rk = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                  hf_cos[None], hf_sin[None])
    # q and k rotated together, as the model does, from a strided view
    qk = apply_rotary(torch.cat([q, k], 1), cos, sin)
    torch.testing.assert_close(qk[:, :6], rq[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(qk[:, 6:], rk[0].transpose(0, 1), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_matches_hf(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    ours, ref = RMSNorm(48, eps=1e-5).to(dtype), LlamaRMSNorm(48, eps=1e-5).to(dtype)
    w = torch.rand(48) + 0.5
    ours.weight.copy_(w)
    with torch.no_grad():
        ref.weight.copy_(w)
    x, res = torch.randn(5, 48, dtype=dtype) * 3, torch.randn(5, 48, dtype=dtype)
    torch.testing.assert_close(ours(x), ref(x), rtol=0, atol=0)
    normed, new_res = ours(x, res)
    torch.testing.assert_close(new_res, x + res, rtol=0, atol=0)
    torch.testing.assert_close(normed, ref(x + res), rtol=0, atol=0)


def test_fused_linear_shards():
    qkv = QKVLinear(hidden_size=8, head_dim=2, num_heads=4, num_kv_heads=2, bias=True)
    q, k, v = torch.randn(8, 8), torch.randn(4, 8), torch.randn(4, 8)
    for shard, w in (("v", v), ("q", q), ("k", k)):
        qkv.weight.weight_loader(qkv.weight, w, shard)
        qkv.bias.weight_loader(qkv.bias, torch.full((w.shape[0],), 1.0), shard)
    x = torch.randn(3, 8)
    torch.testing.assert_close(qkv(x), x @ torch.cat([q, k, v]).T + 1.0)
    gate_up = MergedLinear(8, [5, 5])
    g, u = torch.randn(5, 8), torch.randn(5, 8)
    gate_up.weight.weight_loader(gate_up.weight, u, 1)
    gate_up.weight.weight_loader(gate_up.weight, g, 0)
    torch.testing.assert_close(gate_up(x), x @ torch.cat([g, u]).T)

"""The cost model against hand-computed values (chapter section 1.1 and the
published parameter counts)."""
import pytest

from slipstream.analysis.attention_cost import span
from slipstream.analysis.flops import (Precisions, Workload, count_params, distinct_experts,
                                       model_cost)
from slipstream.analysis.presets import PRESETS


def test_qwen25_72b_per_layer_parameters():
    # d = 8192, 64 query heads and 8 KV heads of 128, d_ff = 29568, q/k/v biases,
    # two RMSNorm weights. K and V are 8192 x 1024 each (GQA), not 8192 x 8192.
    d, kv, ff = 8192, 8 * 128, 29568
    attention = d * d + 2 * d * kv + (d + 2 * kv) + d * d      # q, k, v (+ biases), o
    mlp = 3 * d * ff
    per_layer = attention + mlp + 2 * d
    assert per_layer == 877_684_736   # 151.0M attention + 726.7M MLP
    params = count_params(PRESETS["qwen2.5-72b"])
    assert params.per_layer == (per_layer,) * 80
    # 80 layers + untied embedding and LM head (152064 x 8192 each) = 72.71B;
    # Qwen publishes 72.7B total, 70.0B without embeddings.
    total = 80 * per_layer + 2 * 152064 * d + d
    assert params.total == total
    assert total == pytest.approx(72.7e9, rel=1e-3)
    # The chapter's 8 d^2 + 3 d d_ff = 1.26B per layer overcounts by 44%.
    assert (8 * d * d + 3 * d * ff) / per_layer == pytest.approx(1.44, abs=0.01)


@pytest.mark.parametrize("name, total, active, rel", [
    ("llama-3-8b", 8.03e9, 8.03e9, 2e-3),
    ("llama-3.1-405b", 405.85e9, 405.85e9, 2e-3),
    ("llama-2-70b", 68.98e9, 68.98e9, 2e-3),
    ("gemma-3-27b", 27.0e9, 27.0e9, 5e-3),        # language model; 27.4B with the vision tower
    ("qwen3-235b-a22b", 235e9, 22e9, 1e-2),
    ("deepseek-v3", 671e9, 37e9, 2e-2),           # 37B is rounded down from 37.5B
    ("llama-4-maverick", 400e9, 17e9, 1.2e-2),
    ("llama-4-scout", 109e9, 17e9, 1.2e-2),       # 109B counts the vision encoder too
])
def test_published_parameter_counts(name, total, active, rel):
    params = count_params(PRESETS[name])
    assert params.total == pytest.approx(total, rel=rel)
    assert params.active == pytest.approx(active, rel=rel)


def test_deepseek_v3_by_hand():
    d, h = 7168, 128
    mla = (d * 1536 + 1536 * h * 192          # q down, q up (128 nope + 64 rope per head)
           + d * (512 + 64)                   # kv down: latent + shared rope key
           + 512 * h * (128 + 128)            # kv up: K_nope and V per head
           + h * 128 * d)                     # o
    expert = 3 * d * 2048
    norms = 2 * d + 512 + 1536
    dense_layer = mla + 3 * d * 18432 + norms
    moe_layer = mla + 257 * expert + 256 * d + norms          # 256 routed + 1 shared + router
    embed = 129280 * d
    total = 3 * dense_layer + 58 * moe_layer + 2 * embed + d
    active = 3 * dense_layer + 58 * (moe_layer - 248 * expert) + 2 * embed + d
    params = count_params(PRESETS["deepseek-v3"])
    assert params.total == total
    assert params.active == active


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_flops_per_token_is_twice_active_matmul_weights(name):
    """At context 1 attention is negligible: a decode step does 2 FLOPs per
    weight it multiplies by (all active weights except the embedding lookup)."""
    spec = PRESETS[name]
    flops = model_cost(spec, Workload.decode(1, 1)).total().flops
    assert flops == pytest.approx(2 * count_params(spec).matmul_active, rel=2e-3)


def test_decode_bytes_llama2_70b():
    """Chapter 1.2: one decode step at batch 1 reads every weight once."""
    spec = PRESETS["llama-2-70b"]
    cost = model_cost(spec, Workload.decode(1, 1)).total()
    non_embedding = count_params(spec).total - 32000 * 8192
    # bf16 weights (the embedding contributes one row) + a few MB of activations.
    assert cost.weight_bytes == 2 * (non_embedding + 8192)
    assert cost.bytes == pytest.approx(2 * non_embedding, rel=1e-3)
    assert cost.intensity == pytest.approx(1.0, abs=0.01)


def test_kv_cache_traffic_gqa():
    spec = PRESETS["llama-3-8b"]
    batch, context = 4, 1000
    cost = model_cost(spec, Workload.decode(batch, context)).total()
    per_token = 32 * 2 * 8 * 128 * 2           # layers x (K, V) x kv heads x head_dim x bf16
    assert cost.kv_read_bytes == batch * context * per_token
    assert cost.kv_write_bytes == batch * per_token
    fp8 = model_cost(spec, Workload.decode(batch, context), Precisions.parse(kv="fp8")).total()
    assert fp8.kv_read_bytes == cost.kv_read_bytes / 2


def test_attention_flops_decode_and_prefill():
    spec = PRESETS["llama-3-8b"]
    h, hd = 32, 128
    dec = {op.name: op for op in model_cost(spec, Workload.decode(2, 300)).by_name()}
    assert dec["attn_score"].flops == 32 * 2 * 2 * 300 * h * hd
    n = 512   # causal prefill: n (n + 1) / 2 query-key pairs
    pre = {op.name: op for op in model_cost(spec, Workload.prefill(n)).by_name()}
    assert pre["attn_value"].flops == 32 * 2 * (n * (n + 1) // 2) * h * hd


def test_int4_weights_shrink_bytes():
    spec = PRESETS["llama-3-8b"]
    bf16 = model_cost(spec, Workload.decode(1, 1)).total()
    int4 = model_cost(spec, Workload.decode(1, 1), Precisions.parse(weight="int4")).total()
    block_linear = 32 * (4096 * (4096 + 2048) + 4096 * 4096 + 3 * 4096 * 14336)
    # Block linears drop from 2 bytes to 0.5 + 2/128; head, norms and activations stay bf16.
    assert bf16.weight_bytes - int4.weight_bytes == pytest.approx(
        block_linear * (2 - (0.5 + 2 / 128)), rel=1e-12)
    assert int4.flops == bf16.flops


def test_moe_weight_reads_grow_with_batch():
    assert distinct_experts(256, 8, 1) == pytest.approx(8)
    # Two tokens: 256 (1 - (31/32)^2) = 15.75 distinct experts on average.
    assert distinct_experts(256, 8, 2) == pytest.approx(15.75)
    assert distinct_experts(256, 8, 10_000) == pytest.approx(256)
    spec = PRESETS["qwen3-235b-a22b"]
    one = model_cost(spec, Workload.decode(1, 1)).total().weight_bytes
    many = model_cost(spec, Workload.decode(256, 1)).total().weight_bytes
    assert one == pytest.approx(2 * count_params(spec).active, rel=0.03)
    assert many == pytest.approx(2 * count_params(spec).total, rel=0.02)


def test_mla_decode_reads_the_latent_cache():
    spec = PRESETS["deepseek-v3"]
    cost = model_cost(spec, Workload.decode(1, 4096))
    assert cost.total().kv_read_bytes == 61 * 4096 * 576 * 2
    names = {op.name for op in cost.ops()}
    assert {"absorb_k", "attn_latent", "absorb_v"} <= names and "kv_b_proj" not in names
    # A long prefill expands the latent instead (fewer FLOPs than absorbing).
    assert "kv_b_proj" in {op.name for op in model_cost(spec, Workload.prefill(4096)).ops()}


@pytest.mark.parametrize("past, new, window, kind, pairs, keys", [
    (0, 4, None, "sliding", 10, 4),            # 1 + 2 + 3 + 4
    (5, 1, None, "sliding", 6, 6),
    (2000, 1, 1024, "sliding", 1024, 1024),
    (0, 6, 4, "sliding", 1 + 2 + 3 + 4 + 4 + 4, 6),
    (8200, 1, 8192, "chunked", 9, 9),          # position 8200 sits 8 into its chunk
    (8190, 4, 8192, "chunked", 8191 + 8192 + 1 + 2, 8194),
])
def test_attention_span(past, new, window, kind, pairs, keys):
    s = span(past, new, window, kind)
    assert (s.pairs, s.keys_read) == (pairs, keys)

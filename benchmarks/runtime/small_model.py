"""The fused kernels inside a small random Llama run through the model code
(for bench_fused_ops.py): kernel launches per decoder layer in a decode step,
and fp32 parity of the fused path with the torch ops."""
from __future__ import annotations


def launches_per_layer(torch, device, dtype, fused: bool, smoke: bool) -> dict:
    """CUDA kernels per decoder layer in one decode step (batch 8, context 100)."""
    from torch.profiler import ProfilerActivity, profile

    counts, names = {}, {}
    for layers in (2, 4):
        model, batch = _small_model_step(torch, device, dtype, layers, fused)
        with torch.inference_mode():
            model.backend.prepare(batch)
            model(batch)  # warm-up: compile kernels outside the profile
            if smoke:
                counts[layers] = None
                continue
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                model.backend.prepare(batch)
                model(batch)
                torch.cuda.synchronize()
        kernels = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
        counts[layers], names[layers] = len(kernels), kernels
    if smoke:
        return {"per_layer": None, "note": "no CUDA on this machine: the path ran, nothing counted"}
    per_layer = (counts[4] - counts[2]) / 2
    # The layers run in order: a 4-layer step is the 2-layer one with two more
    # layers in the middle, so its kernels past the 2-layer prefix minus the tail
    # are those two layers; one layer is the first half of them.
    k = int(per_layer)
    head = _common_prefix(names[2], names[4])
    layer_kernels = names[4][head:head + k] if k > 0 else []
    return {"per_layer": per_layer, "step_total_4_layers": counts[4],
            "step_total_2_layers": counts[2], "layer_kernels": layer_kernels,
            "kernels_4_layers": names[4]}


def _common_prefix(a: list[str], b: list[str]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _small_model_step(torch, device, dtype, num_layers: int, fused: bool):
    from slipstream.attention.selector import create_backend
    from slipstream.batch import ForwardBatch
    from slipstream.config import ModelConfig
    from slipstream.layers.activation import SiluAndMul
    from slipstream.layers.norm import RMSNorm
    from slipstream.layers.rotary import RotaryEmbedding
    from slipstream.loader.dummy import initialize_dummy_weights
    from slipstream.models.llama import LlamaForCausalLM
    mc = ModelConfig("llama", vocab_size=512, hidden_size=256, intermediate_size=512,
                     num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=64, max_position_embeddings=512)
    backend = create_backend("triton", torch.device(device))
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(mc, backend)
    finally:
        torch.set_default_dtype(old)
    initialize_dummy_weights(model, seed=0)
    for m in model.modules():
        if isinstance(m, (RMSNorm, SiluAndMul, RotaryEmbedding)):
            m.use_kernel = fused
    b, ctx, bs = 8, 100, 16
    blocks = -(-(ctx + 1) // bs)
    torch.manual_seed(1)   # the same KV cache contents for every model built here
    for layer in model.attention_layers():
        shape = (b * blocks, bs, mc.num_key_value_heads, mc.head_dim)
        layer.k_cache = torch.randn(shape, device=device).to(dtype)
        layer.v_cache = torch.randn(shape, device=device).to(dtype)
    tables = torch.arange(b * blocks, dtype=torch.int32).view(b, blocks)
    slots = tables[:, ctx // bs].long() * bs + ctx % bs
    t = lambda v: v.to(device)  # noqa: E731
    batch = ForwardBatch(
        input_ids=t(torch.randint(0, mc.vocab_size, (b,))), positions=t(torch.full((b,), ctx)),
        query_start_loc=t(torch.arange(b + 1, dtype=torch.int32)),
        seq_lens=t(torch.full((b,), ctx + 1, dtype=torch.int32)),
        context_lens=t(torch.full((b,), ctx, dtype=torch.int32)), slot_mapping=t(slots),
        block_tables=t(tables), logits_indices=t(torch.arange(b)), max_query_len=1,
        max_seq_len=ctx + 1, query_lens_cpu=[1] * b, seq_lens_cpu=[ctx + 1] * b,
        num_decode_seqs=b)
    return model, batch


def model_parity(torch, device) -> dict:
    """fp32 decode-step logits of a small random Llama, fused kernels against the
    torch ops (same weights, same KV cache): only fp32 operation order differs."""
    logits = {}
    for fused in (True, False):
        model, batch = _small_model_step(torch, device, torch.float32, 2, fused)
        with torch.inference_mode():
            model.backend.prepare(batch)
            logits[fused] = model.compute_logits(model(batch)[batch.logits_indices])
    diff = (logits[True] - logits[False]).abs().max().item()
    return {"max_abs_logit_diff": diff, "logit_std": logits[False].std().item(), "ok": diff < 1e-3}

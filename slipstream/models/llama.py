"""The Llama family in one implementation: Llama 2/3, Qwen2, Mistral, SmolLM2.

Pre-norm decoder: GQA attention with RoPE, RMSNorm, SwiGLU MLP. The family
differences are configuration: q/k/v bias (Qwen2), a sliding window (Mistral),
tied embeddings (SmolLM2), Llama-3 RoPE scaling.

Module names mirror Hugging Face's, except that q/k/v and gate/up are fused
(`qkv_proj`, `gate_up_proj`); `load_weights` maps checkpoint names onto them.
The residual stream stays in the model dtype; norms compute in fp32 inside.
On CUDA the elementwise work of a layer runs as fused Triton kernels (add +
RMSNorm, rotary in place on the qkv output, SiLU * up), so a decode step
launches about ten kernels per layer: norm, qkv GEMM, rotary, KV store,
attention (1-2), o_proj GEMM, add + norm, gate_up GEMM, silu * up, down GEMM.
At batch 1 on Hopper o_proj and the LM head run a TMA GEMV of our own; with
SLIPSTREAM_TMA_GEMV=1 every product does, the norms and SiLU inside the GEMVs after
them (layers/decode_gemv.py: qkv, rotary + KV store, attention, o_proj, gate_up,
down; measured slower through the engine than cuBLAS and the separate kernels).
With the triton attention backend the rotary is done in its KV-store kernel
(`Attention.fuses_rotary`), and short decode contexts take one attention kernel.
The CPU runs the same layers' plain torch ops.

Tensor parallelism (`tp`, see layers/linear.py and layers/embedding.py): each
rank builds the same module tree holding its slice of every matrix, its query
and KV heads; the attention output and the MLP end in a row-parallel layer
with one all-reduce each, so a layer costs two all-reduces of
[num_tokens, hidden].
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from slipstream.attention.base import AttentionBackend
from slipstream.config import ModelConfig
from slipstream.distributed.parallel import check_shardable, kv_heads_of_rank
from slipstream.errors import ModelLoadError
from slipstream.layers.activation import SiluAndMul
from slipstream.layers.attention import Attention
from slipstream.layers.embedding import LMHead, VocabEmbedding
from slipstream.layers.linear import (LinearBase, MergedLinear, QKVLinear,
                                      RowParallelLinear, UnquantizedLinearMethod)
from slipstream.layers.norm import RMSNorm
from slipstream.layers.rotary import RotaryEmbedding, StepRotary
from slipstream.layers.weight_loader import default_weight_loader
from slipstream.models.registry import family_traits
from slipstream.quant.activation import input_quant
from slipstream.quant.base import QuantMethodFor
from slipstream.batch import ForwardBatch


# Checkpoint name fragment -> (fused module fragment, shard id).
_STACKED = (
    (".q_proj.", ".qkv_proj.", "q"),
    (".k_proj.", ".qkv_proj.", "k"),
    (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
)
# Checkpoint tensors that hold nothing the model needs (precomputed RoPE tables).
_IGNORED = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def _no_quant(prefix: str) -> None:
    return None


def _tp_size(tp) -> int:
    return 1 if tp is None else tp.size


def _plain(layer: LinearBase) -> bool:
    """An unquantized product without bias on one rank: its GEMV can fold in the op before it."""
    return (isinstance(layer.quant_method, UnquantizedLinearMethod) and layer.bias is None
            and layer.tp_size == 1)


def _table_method(quant_method_for: QuantMethodFor, prefix: str):
    """The method for an embedding table, if the scheme has one that serves tables."""
    method = quant_method_for(prefix)
    return method if getattr(method, "supports_embedding", False) else None


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, backend: AttentionBackend,
                 quant_method_for: QuantMethodFor, prefix: str, tp=None):
        super().__init__()
        size = _tp_size(tp)
        # The rank's heads (all of them at tensor_parallel_size 1).
        self.num_heads = config.num_attention_heads // size
        self.num_kv_heads = kv_heads_of_rank(config.num_key_value_heads, 0, size)[1]
        self.head_dim = config.head_dim
        o_bias = config.attention_bias and \
            family_traits(config.architecture).o_proj_bias_with_attention_bias
        self.qkv_proj = QKVLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                  config.num_key_value_heads, bias=config.attention_bias,
                                  quant_method=quant_method_for(f"{prefix}.qkv_proj"), tp=tp)
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim,
                                        config.hidden_size, bias=o_bias,
                                        quant_method=quant_method_for(f"{prefix}.o_proj"), tp=tp)
        self.attn = Attention(layer_idx, self.num_heads, self.num_kv_heads, self.head_dim,
                              backend, sliding_window=config.sliding_window)

    def forward(self, x: torch.Tensor, rope: StepRotary, batch: ForwardBatch) -> torch.Tensor:
        # x: [num_tokens, hidden] -> [num_tokens, hidden]
        h, hk = self.num_heads, self.num_heads + self.num_kv_heads
        qkv = self.qkv_proj(x).view(x.shape[0], hk + self.num_kv_heads, self.head_dim)
        if self.attn.fuses_rotary(rope):  # rotated in place by the backend's KV-store kernel
            o = self.attn(qkv[:, :h], qkv[:, h:hk], qkv[:, hk:], batch, rope=rope)
            return self.o_proj(o.flatten(1))
        # Rotate the q and k heads together: one kernel (in place, on CUDA) or one
        # set of elementwise ops per layer.
        qk = rope(qkv[:, :hk])                          # [num_tokens, heads + kv_heads, head_dim]
        o = self.attn(qk[:, :h], qk[:, h:], qkv[:, hk:], batch)  # [num_tokens, heads, head_dim]
        return self.o_proj(o.flatten(1))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, quant_method_for: QuantMethodFor, prefix: str,
                 tp=None):
        super().__init__()
        if config.hidden_act != "silu":
            raise ModelLoadError(f"unsupported hidden_act {config.hidden_act!r}; expected silu")
        inter = config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, [inter, inter],
                                         quant_method=quant_method_for(f"{prefix}.gate_up_proj"),
                                         tp=tp)
        self.down_proj = RowParallelLinear(inter, config.hidden_size,
                                           quant_method=quant_method_for(f"{prefix}.down_proj"),
                                           tp=tp)
        self.act = SiluAndMul()
        self.act.quant = input_quant(self.down_proj)   # W8A8: SiLU * up writes codes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, hidden] -> [num_tokens, hidden]
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, backend: AttentionBackend,
                 quant_method_for: QuantMethodFor, prefix: str, tp=None):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, backend, quant_method_for,
                                        f"{prefix}.self_attn", tp)
        self.mlp = LlamaMLP(config, quant_method_for, f"{prefix}.mlp", tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # W8A8 qkv / gate_up: the norms before them write per-token codes directly.
        self.input_layernorm.quant = input_quant(self.self_attn.qkv_proj)
        self.post_attention_layernorm.quant = input_quant(self.mlp.gate_up_proj)
        # Plain products: at one row on Hopper the norms and SiLU before them run inside
        # their GEMVs (layers/decode_gemv.py).
        attn, mlp = self.self_attn, self.mlp
        for linear, role in ((attn.qkv_proj, "qkv"), (attn.o_proj, "o"),
                             (mlp.gate_up_proj, "gate_up"), (mlp.down_proj, "down")):
            linear.gemv_role = role
        for op, linear in ((self.input_layernorm, attn.qkv_proj),
                           (self.post_attention_layernorm, mlp.gate_up_proj), (mlp.act, mlp.down_proj)):
            op.fold = linear.gemv_role if _plain(linear) else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: StepRotary,
                batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [num_tokens, hidden], the previous sublayer's output; residual: the
        stream before it (None at layer 0, where x is the embedding).
        Returns (mlp output, residual stream before it); their sum is the layer's output."""
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, rope, batch)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend,
                 quant_method_for: QuantMethodFor, tp=None):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, tp,
                                           _table_method(quant_method_for, "model.embed_tokens"))
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                      config.rope_theta, config.rope_scaling)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, backend, quant_method_for, f"model.layers.{i}", tp)
            for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # CPU decode steps over GGUF blocks: kernels/cpu_decoder.py, built at the
        # first CPU step (False: this model does not qualify).
        self.cpu_decoder = None
        # Layers (ascending) whose output, the residual stream after them, is appended
        # to the final hidden states (`LlamaForCausalLM.set_feature_taps`).
        self.feature_taps: tuple[int, ...] = ()

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        # -> final normed hidden states [num_tokens, hidden], then one [.., hidden]
        # block per feature tap: [num_tokens, (1 + taps) * hidden]
        x = self.embed_tokens(batch.input_ids)
        if self.cpu_decoder is None and x.device.type == "cpu":
            from slipstream.kernels.cpu_decoder import CPUDecoder
            self.cpu_decoder = CPUDecoder.build(self) or False
        if self.cpu_decoder and self.cpu_decoder.accepts(batch):
            return self.cpu_decoder(x, batch)   # the whole step in one C call (same math)
        rope = self.rotary_emb.for_step(batch.positions)  # once a step, shared by every layer
        residual, taps = None, []
        tap_at = self.feature_taps if batch.features else ()
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, rope, batch)
            if i in tap_at:
                taps.append(x + residual)
        x, _ = self.norm(x, residual)
        return torch.cat([x] + taps, dim=-1) if taps else x


class LlamaForCausalLM(nn.Module):
    """Build on a device and dtype with `with torch.device(d): m = LlamaForCausalLM(...)`
    then `m.to(dtype)` (or under `torch.set_default_dtype`); then `load_weights`."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend,
                 quant_method_for: QuantMethodFor | None = None, tp=None):
        """tp: this rank's `distributed.parallel.TPGroup` (None: the whole model here)."""
        super().__init__()
        if tp is not None:
            check_shardable(config, tp.size)
        self.config = config
        self.backend = backend
        self.model = LlamaModel(config, backend, quant_method_for or _no_quant, tp)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size,
                              tied_to=self.model.embed_tokens if config.tie_word_embeddings
                              else None, tp=tp,
                              quant_method=_table_method(quant_method_for or _no_quant, "lm_head"))

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """One step over `batch` (writes its K/V into the caches)
        -> hidden states [num_tokens, hidden_size], after the final norm.
        The caller has run `backend.prepare(batch)` for this step."""
        return self.model(batch)

    def compute_logits(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        # hidden: [n, hidden_size] (or the forward's wider rows: their first
        # hidden_size columns) -> logits [n, vocab_size] float32 (fp32=False: left in
        # the product's dtype where it has one; the same argmax, since the cast is exact)
        h = self.config.hidden_size
        return self.lm_head(hidden if hidden.shape[-1] == h else hidden[..., :h], fp32=fp32)

    def set_feature_taps(self, layers) -> None:
        """Make the forward return, after the final hidden states, the output of
        each of `layers` (ascending decoder-layer indices; the residual stream
        after the layer): the fused low / middle / high features an EAGLE-3 draft
        head reads. Set before the first step (CUDA graphs capture the width)."""
        layers = tuple(int(i) for i in layers)
        n = self.config.num_hidden_layers
        if list(layers) != sorted(set(layers)) or any(not 0 <= i < n for i in layers):
            raise ValueError(f"feature taps: distinct ascending layer indices in [0, {n}), "
                             f"got {list(layers)}")
        self.model.feature_taps = layers

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def fuse_all_reduce_norm(self, op) -> int:
        """Let each row-parallel layer's sum happen in the RMSNorm after it (op: a
        fused all-reduce + residual add + norm, distributed/all_reduce_norm.py; None
        undoes it). Norms that quantize their output keep the plain all-reduce.
        Returns how many sums are fused."""
        layers, fused = self.model.layers, 0
        for i, layer in enumerate(layers):
            after_mlp = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            for linear, norm in ((layer.self_attn.o_proj, layer.post_attention_layernorm),
                                 (layer.mlp.down_proj, after_mlp)):
                use = op if norm.quant is None else None
                linear.defer_to, norm.reduce = use, use
                fused += use is not None
        return fused

    def _checkpoint_targets(self) -> dict[str, tuple[nn.Parameter, object]]:
        """Checkpoint tensor name -> (parameter, shard id) for every tensor we need."""
        targets: dict[str, tuple[nn.Parameter, object]] = {}
        for name, param in self.named_parameters():  # tied lm_head.weight is listed once
            shards = [(name.replace(fused, ckpt), shard)
                      for ckpt, fused, shard in _STACKED if fused in name]
            for ckpt_name, shard in shards or [(name, None)]:
                targets[ckpt_name] = (param, shard)
        return targets

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face-named tensors (converted to each parameter's dtype/device).

        Raises ModelLoadError naming missing or unexpected tensors and shape mismatches.
        """
        targets = self._checkpoint_targets()
        seen: set[str] = set()
        unexpected: list[str] = []
        for name, tensor in weights:
            if any(part in name for part in _IGNORED):
                continue
            if name == "lm_head.weight" and self.lm_head.tied:
                continue  # the embedding serves as the LM head
            target = targets.get(name)
            if target is None:
                unexpected.append(name)
                continue
            param, shard = target
            loader = getattr(param, "weight_loader", default_weight_loader)
            try:
                loader(param, tensor, shard)
            except ModelLoadError as e:
                raise ModelLoadError(f"checkpoint tensor {name!r}: {e}") from None
            seen.add(name)
        missing = sorted(set(targets) - seen)
        if missing or unexpected:
            raise ModelLoadError(_load_report(missing, unexpected))
        for module in self.modules():
            if isinstance(module, LinearBase):
                module.quant_method.process_after_loading(module)


def _load_report(missing: list[str], unexpected: list[str], most: int = 8) -> str:
    def names(xs: list[str]) -> str:
        more = f" (+{len(xs) - most} more)" if len(xs) > most else ""
        return ", ".join(xs[:most]) + more
    parts = []
    if missing:
        parts.append(f"{len(missing)} tensors missing from the checkpoint: {names(missing)}")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected tensors in the checkpoint: "
                     f"{names(unexpected)}")
    return "; ".join(parts)

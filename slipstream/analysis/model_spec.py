"""The shape of a decoder-only transformer, as far as its cost depends on it.

Wider than `slipstream.config.ModelConfig` (which describes what the engine can
run): mixture-of-experts layers, multi-head latent attention, and windowed
attention on some layers, so that every model of the reference chapter can be
described and costed.
"""
from __future__ import annotations

from dataclasses import dataclass

WINDOW_KINDS = ("sliding", "chunked")


@dataclass(frozen=True)
class MoESpec:
    """Routed experts (+ optional always-on shared experts) replacing the MLP."""
    num_experts: int
    experts_per_token: int
    expert_intermediate_size: int
    num_shared_experts: int = 0
    shared_intermediate_size: int | None = None  # per shared expert; None: same as a routed one
    first_dense_layers: int = 0   # DeepSeek-V3: layers 0..2 keep a dense MLP
    every: int = 1                # after those, layer i is MoE when (i + 1) % every == 0

    @property
    def shared_width(self) -> int:
        width = self.shared_intermediate_size or self.expert_intermediate_size
        return self.num_shared_experts * width


@dataclass(frozen=True)
class MLASpec:
    """Multi-head latent attention (DeepSeek-V2/V3): the cache holds one latent
    vector of kv_lora_rank (d_c) plus a shared rope key per token, not K and V."""
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None   # None: queries projected directly from the hidden state


@dataclass(frozen=True)
class ModelSpec:
    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int           # width of the dense MLP (dense layers)
    vocab_size: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False     # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False            # RMSNorm over each q and k head (Qwen3, Gemma 3)
    norms_per_layer: int = 2         # Gemma 2/3 add post-attention and post-MLP norms: 4
    window: int | None = None        # local attention span on non-global layers
    window_kind: str = "sliding"     # "sliding": last `window` keys; "chunked": own chunk only
    global_every: int = 0            # with a window: layer i is global when (i + 1) % global_every == 0;
                                     # 0: every layer is windowed (Mistral)
    moe: MoESpec | None = None
    mla: MLASpec | None = None

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.name}: {self.num_heads} heads do not split into "
                             f"{self.num_kv_heads} KV groups")
        if self.window_kind not in WINDOW_KINDS:
            raise ValueError(f"{self.name}: window kind {self.window_kind!r} not in {WINDOW_KINDS}")

    def is_moe_layer(self, layer: int) -> bool:
        moe = self.moe
        return moe is not None and layer >= moe.first_dense_layers and (layer + 1) % moe.every == 0

    def layer_window(self, layer: int) -> int | None:
        """Attention span limit of `layer`; None: attends to the whole context."""
        if self.window is None or (self.global_every and (layer + 1) % self.global_every == 0):
            return None
        return self.window

    @property
    def kv_elements_per_token(self) -> int:
        """Cached elements per token per layer: K and V of every KV head, or
        MLA's latent vector plus its shared rope key."""
        if self.mla is not None:
            return self.mla.kv_lora_rank + self.mla.qk_rope_head_dim
        return 2 * self.num_kv_heads * self.head_dim

    @classmethod
    def from_model_config(cls, cfg, name: str | None = None) -> "ModelSpec":
        """From the `ModelConfig` of a model slipstream has loaded."""
        return cls(
            name=name or cfg.architecture,
            hidden_size=cfg.hidden_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            intermediate_size=cfg.intermediate_size,
            vocab_size=cfg.vocab_size,
            tie_word_embeddings=cfg.tie_word_embeddings,
            attention_bias=cfg.attention_bias,
            window=cfg.sliding_window,
        )

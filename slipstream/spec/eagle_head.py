"""The EAGLE draft head: one decoder layer over the target's features and the
next token's embedding (fc([embed(t) ; f]) -> attention over its own K/V ->
MLP -> norm), whose output guesses the target's next feature; saved and loaded
as safetensors with its shape in the metadata. spec/eagle.py drafts with it.
A head trained for parallel drafting (`parallel`, spec/peagle.py) also holds a
placeholder token embedding and feature for the positions it drafts blind.

The feature of a real position is the target's final hidden state (EAGLE-1/2),
or, for a head with `feature_layers` (EAGLE-3), the outputs of a low, a middle
and a high decoder layer, each RMS-normalised and fused by one linear layer
(`fc_taps`, 3 hidden -> hidden). The target then returns those layers' outputs
beside its final hidden states (`LlamaForCausalLM.set_feature_taps`), and
`target_feature` turns such a row into the head's feature. Drafted positions
feed the head's own output back, as before.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.layers.rotary import RotaryEmbedding, apply_rotary

# On a GPU the head's attention is given what scaled_dot_product_attention's fused
# kernels take: 4-D inputs, and K/V heads repeated for the query heads instead of
# enable_gqa. With 3-D inputs it ran its math path (fp32 products, separate mask and
# softmax kernels): an eager EAGLE loop round on the H200 took 2.49 ms instead of 2.27
# (benchmarks/spec/README.md, "Trimming the round").
# Which GPU kernel runs it: "triton" takes kernels/masked_attention.py (one launch, K/V
# read once per GQA group; the compiled EAGLE round on the H200 1.348 against 1.375 ms
# with cuDNN's, benchmarks/spec/README.md); "" lets SDPA choose (cuDNN's there, ~9 us a
# draft level, and a memset before each); "efficient", "flash", "cudnn" or "math" forces
# one of SDPA's (efficient and math measured slower than cuDNN's in that round).
gpu_sdpa = "triton"
_SDPA_BACKENDS = {"efficient": "EFFICIENT_ATTENTION", "flash": "FLASH_ATTENTION",
                  "cudnn": "CUDNN_ATTENTION", "math": "MATH"}


@dataclass(frozen=True)
class EagleShape:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10000.0
    max_position: int = 8192
    eps: float = 1e-5
    parallel: int = 0    # 1: placeholder inputs for parallel drafting (spec/peagle.py)
    feature_layers: str = ""   # "2,15,27": fuse these layers' outputs (EAGLE-3); "": final

    @property
    def taps(self) -> tuple[int, ...]:
        return tuple(int(i) for i in self.feature_layers.split(",") if i.strip())


def eagle3_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low, middle and high layers of a target with `num_layers` layers."""
    return tuple(sorted({min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0)}))


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    # One fused op (drafting is launch-bound on a GPU); the weight in x's dtype,
    # so that mixed dtypes under autocast (training) meet one dtype.
    return F.rms_norm(x, (x.shape[-1],), w.to(x.dtype), eps)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
              fused: bool) -> torch.Tensor:
    """q [T, heads, d], k / v [C, kv_heads, d], mask [T, C] bool -> [T, heads, d].
    fused: the inputs shaped for SDPA's fused kernels (the GPU's choice, above)."""
    group = q.shape[1] // k.shape[1]
    if fused and gpu_sdpa == "triton" and not (torch.is_grad_enabled() and q.requires_grad):
        from slipstream.kernels import masked_attention as ma        # (it has no backward)
        if ma.supported(q.shape[-1]):
            return ma.masked_attention_op(q, k, v, mask)
    if fused:
        if group > 1:
            k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
        args = (q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None])
        if gpu_sdpa in _SDPA_BACKENDS:
            from torch.nn.attention import SDPBackend, sdpa_kernel
            with sdpa_kernel(getattr(SDPBackend, _SDPA_BACKENDS[gpu_sdpa])):
                o = F.scaled_dot_product_attention(*args, attn_mask=mask[None, None])
        else:
            o = F.scaled_dot_product_attention(*args, attn_mask=mask[None, None])
        return o[0].transpose(0, 1)
    return F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
        enable_gqa=group > 1).transpose(0, 1)


class EagleHead(nn.Module):
    def __init__(self, s: EagleShape):
        super().__init__()
        self.shape = s
        h, d = s.hidden_size, s.head_dim
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.q = nn.Linear(h, s.num_heads * d, bias=False)
        self.k = nn.Linear(h, s.num_kv_heads * d, bias=False)
        self.v = nn.Linear(h, s.num_kv_heads * d, bias=False)
        self.o = nn.Linear(s.num_heads * d, h, bias=False)
        self.gate_up = nn.Linear(h, 2 * s.intermediate_size, bias=False)
        self.down = nn.Linear(s.intermediate_size, h, bias=False)
        self.attn_norm = nn.Parameter(torch.ones(h))
        self.mlp_norm = nn.Parameter(torch.ones(h))
        self.out_norm = nn.Parameter(torch.ones(h))
        self.rotary = RotaryEmbedding(d, s.max_position, s.rope_theta)
        if s.taps:       # EAGLE-3: the target's low / middle / high layers, fused
            self.fc_taps = nn.Linear(len(s.taps) * h, h, bias=False)
        if s.parallel:   # P-EAGLE: the token and feature of a position still unknown
            self.mask_emb = nn.Parameter(torch.randn(h) * 0.02)
            self.mask_feat = nn.Parameter(torch.randn(h) * 0.02)
        self.qkv_weight: torch.Tensor | None = None   # [q; k; v] rows, set for drafting by load

    def forward(self, emb: torch.Tensor, feat: torch.Tensor, positions: torch.Tensor,
                past: tuple[torch.Tensor, torch.Tensor] | None, mask: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """emb, feat: [T, hidden]; positions: [T]; past: K, V [C, kv_heads, head_dim]
        (or lists of blocks of such rows, C in all);
        mask: [T, C + T] bool (None: causal over the T new rows, all of past).
        Returns (predicted features [T, hidden], K [T, kv_heads, d], V [T, kv_heads, d])."""
        t = emb.shape[0]
        x = self.fuse(emb, feat)
        q, k, v = self.qkv(x, *self.rotary.lookup(positions))
        if past is None:
            kk, vv = k, v
        else:   # past K / V: tensors, or lists of row blocks (one copy here, not two)
            pk, pv = ([p] if torch.is_tensor(p) else list(p) for p in past)
            kk, vv = torch.cat(pk + [k]), torch.cat(pv + [v])
        if mask is None:
            c = kk.shape[0] - t
            mask = torch.ones(t, c + t, dtype=torch.bool, device=x.device)
            mask[:, c:] = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        o = attention(q, kk, vv, mask, q.is_cuda)
        return self.finish(x, o), k, v

    @property
    def dtype(self) -> torch.dtype:
        """The head's activation dtype (its linear layers may hold quantized blocks)."""
        return self.attn_norm.dtype

    @property
    def device(self) -> torch.device:
        return self.attn_norm.device

    def target_feature(self, rows: torch.Tensor) -> torch.Tensor:
        """The target's rows [..., (1 + taps) * hidden] (its final hidden states,
        then its feature taps: `LlamaForCausalLM.set_feature_taps`) -> the head's
        feature of each position [..., hidden], in the head's dtype."""
        s = self.shape
        h, n = s.hidden_size, len(s.taps)
        dt = self.dtype
        if not n:
            return rows[..., :h].to(dt)
        if rows.shape[-1] != (1 + n) * h:
            raise ValueError(f"this EAGLE-3 head reads layers {s.feature_layers} of the target: "
                             f"rows of {(1 + n) * h} values, got {rows.shape[-1]}")
        taps = rows[..., h:].unflatten(-1, (n, h)).to(dt)
        taps = F.rms_norm(taps, (h,), eps=s.eps)
        return self.fc_taps(taps.flatten(-2))

    # The layer in three parts (training runs them over [batch, T, ...] with its own masks).
    def fuse(self, emb: torch.Tensor, feat: torch.Tensor) -> torch.Tensor:
        """[..., hidden] each -> the fused input [..., hidden]."""
        return self.fc(torch.cat([emb, feat], dim=-1))

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x: [..., T, hidden]; cos, sin: [T, 1, head_dim] -> q [..., T, heads, d],
        k, v [..., T, kv_heads, d] (q and k rotated)."""
        s = self.shape
        a = _rms(x, self.attn_norm, s.eps)
        if self.qkv_weight is not None and not torch.is_grad_enabled():
            # Drafting: one product for q, k, v and one rotation of q and k (5 launches, not 10).
            h, hk = s.num_heads, s.num_heads + s.num_kv_heads
            y = F.linear(a, self.qkv_weight).unflatten(-1, (hk + s.num_kv_heads, s.head_dim))
            qk = apply_rotary(y[..., :hk, :], cos, sin)
            return qk[..., :h, :], qk[..., h:, :], y[..., hk:, :]
        q = apply_rotary(self.q(a).unflatten(-1, (s.num_heads, s.head_dim)), cos, sin)
        k = apply_rotary(self.k(a).unflatten(-1, (s.num_kv_heads, s.head_dim)), cos, sin)
        return q, k, self.v(a).unflatten(-1, (s.num_kv_heads, s.head_dim))

    def finish(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """x: [..., hidden] fused input; o: [..., heads, d] attention output ->
        the predicted features [..., hidden]."""
        s = self.shape
        x = x + self.o(o.flatten(-2))
        g, u = self.gate_up(_rms(x, self.mlp_norm, s.eps)).chunk(2, dim=-1)
        x = x + self.down(F.silu(g) * u)
        return _rms(x, self.out_norm, s.eps)

    def save(self, path: str | Path, draft_vocab: torch.Tensor | None = None) -> None:
        from safetensors.torch import save_file
        tensors = {n: p.detach().half().contiguous() for n, p in self.named_parameters()}
        if draft_vocab is not None:
            tensors["draft_vocab"] = draft_vocab.to(torch.int32).contiguous()
        meta = {k: str(v) for k, v in self.shape.__dict__.items()}
        save_file(tensors, str(path), metadata={"kind": "eagle", **meta})

    @classmethod
    def load(cls, path: str | Path, device="cpu", dtype=torch.float32) -> "EagleHead":
        from safetensors import safe_open
        with safe_open(str(path), "pt") as f:
            meta = f.metadata()
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        types = EagleShape.__annotations__
        cast = {"float": float, "str": str}
        shape = EagleShape(**{k: cast.get(types[k], int)(v) for k, v in meta.items() if k in types})
        with torch.device(device):
            head = cls(shape)
        head.load_state_dict({k: v.to(dtype) for k, v in tensors.items() if k != "draft_vocab"},
                             strict=False)
        head = head.to(dtype).requires_grad_(False).eval()
        head.qkv_weight = torch.cat([head.q.weight, head.k.weight, head.v.weight]).contiguous()
        return head

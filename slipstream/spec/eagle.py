"""EAGLE: a one-layer draft head that runs autoregressively over the target's
features, with a dynamic draft tree (EAGLE-2).

The head reads pairs (f_j, t_{j+1}): the target's final hidden state at
position j and the token that followed it, fuses them
(fc([embed(t_{j+1}) ; f_j])), runs one decoder layer (attention over its own
K/V of the earlier pairs), and its normed output f^_{j+1} is a guess at the
target's next feature; the target's frozen LM head turns it into draft logits
for token j + 2. Drafting feeds f^ back in as the next pair's feature.

Tree (EAGLE-2): level 1 holds the top-k tokens after the root; each level the
`beam` nodes of highest cumulative draft log-probability are expanded by
their top-k children; after `depth` levels the `max_nodes` best nodes overall
(their ancestors included, since a child never scores above its parent) form
the tree. Drafts are deterministic (q one-hot).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.layers.rotary import RotaryEmbedding, apply_rotary
from slipstream.spec.base import ProposeRequest, register_proposer
from slipstream.spec.tree import DraftTree


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


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    # One fused op (drafting is launch-bound on a GPU); the weight in x's dtype,
    # so that mixed dtypes under autocast (training) meet one dtype.
    return F.rms_norm(x, (x.shape[-1],), w.to(x.dtype), eps)


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

    def forward(self, emb: torch.Tensor, feat: torch.Tensor, positions: torch.Tensor,
                past: tuple[torch.Tensor, torch.Tensor] | None, mask: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """emb, feat: [T, hidden]; positions: [T]; past: K, V [C, kv_heads, head_dim];
        mask: [T, C + T] bool (None: causal over the T new rows, all of past).
        Returns (predicted features [T, hidden], K [T, kv_heads, d], V [T, kv_heads, d])."""
        t = emb.shape[0]
        x = self.fuse(emb, feat)
        q, k, v = self.qkv(x, *self.rotary.lookup(positions))
        kk, vv = (k, v) if past is None else (torch.cat([past[0], k]), torch.cat([past[1], v]))
        if mask is None:
            c = kk.shape[0] - t
            mask = torch.ones(t, c + t, dtype=torch.bool, device=x.device)
            mask[:, c:] = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1), kk.transpose(0, 1), vv.transpose(0, 1), attn_mask=mask,
            enable_gqa=self.shape.num_heads != self.shape.num_kv_heads).transpose(0, 1)
        return self.finish(x, o), k, v

    # The layer in three parts (training runs them over [batch, T, ...] with its own masks).
    def fuse(self, emb: torch.Tensor, feat: torch.Tensor) -> torch.Tensor:
        """[..., hidden] each -> the fused input [..., hidden]."""
        return self.fc(torch.cat([emb, feat], dim=-1))

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x: [..., T, hidden]; cos, sin: [T, 1, head_dim] -> q [..., T, heads, d],
        k, v [..., T, kv_heads, d] (q and k rotated)."""
        s = self.shape
        a = _rms(x, self.attn_norm, s.eps)
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
        shape = EagleShape(**{k: (float if types[k] == "float" else int)(v)
                              for k, v in meta.items() if k in types})
        with torch.device(device):
            head = cls(shape)
        head.load_state_dict({k: v.to(dtype) for k, v in tensors.items() if k != "draft_vocab"},
                             strict=False)
        return head.to(dtype).requires_grad_(False).eval()


class EagleProposer:
    needs_hidden = True

    def __init__(self, head: EagleHead, embed, lm_head, depth: int = 5, topk: int = 4,
                 beam: int = 4, max_nodes: int = 16):
        """lm_head: features [n, hidden] -> logits [n, V'] (the target's LM head,
        or a `heads.DraftLMHead` over a draft vocabulary, whose `token_ids`
        maps columns to token ids)."""
        if min(depth, topk, beam, max_nodes) < 1:
            raise ValueError("eagle depth, topk, beam and max_nodes must be at least 1")
        self.head, self.embed, self.lm_head = head, embed, lm_head
        self.token_ids = getattr(lm_head, "token_ids", lambda cols: cols)
        self.depth, self.topk, self.beam, self.max_nodes = depth, topk, beam, max_nodes
        self.kv: dict[str, tuple[torch.Tensor, torch.Tensor, int]] = {}

    def release(self, request_id: str) -> None:
        self.kv.pop(request_id, None)

    @torch.inference_mode()
    def propose(self, requests: list[ProposeRequest]) -> list[DraftTree]:
        return [self._one(r) for r in requests]

    def _catch_up(self, r: ProposeRequest) -> torch.Tensor:
        """Run the real pairs new since the last call; returns f^ after the root.
        State per request: K, V of pairs [start, start + len). The runner may
        hand over fewer states than the whole history (prefix-cache hits,
        speculation paused): a gap restarts the head's context at the first
        pair it is given, which only costs acceptance."""
        dt = self.head.fc.weight.dtype
        m, length = r.hidden.shape[0], len(r.token_ids)
        first = length - 1 - m                     # pairs j in [first, L - 1)
        past = self.kv.get(r.request_id)
        if past is not None:
            k0, v0, start = past
            end = start + k0.shape[0]
            if end < first or first < start:
                past = None
            elif end > first:                      # states sent twice: keep one copy
                past = (k0[:first - start], v0[:first - start], start)
        start = first if past is None else past[2]
        dev = r.hidden.device
        toks = torch.tensor(list(r.token_ids[first + 1:length]), device=dev)
        pos = torch.arange(first, length - 1, device=dev)
        f, k, v = self.head(self.embed(toks).to(dt), r.hidden.to(dt), pos,
                            None if past is None else past[:2], None)
        if past is not None:
            k, v = torch.cat([past[0], k]), torch.cat([past[1], v])
        self.kv[r.request_id] = (k, v, start)
        return f[-1]

    def _one(self, r: ProposeRequest) -> DraftTree:
        """EAGLE-2's dynamic tree, built on the device; one host transfer at the end."""
        root_feat = self._catch_up(r)
        dt, dev = root_feat.dtype, root_feat.device
        past_k, past_v, _ = self.kv[r.request_id]
        ctx = past_k.shape[0]                     # real pairs held
        base = len(r.token_ids) - 1               # absolute position of the first draft pair
        k = self.topk
        logp = torch.log_softmax(self.lm_head(root_feat[None]).float(), -1)[0]
        top = logp.topk(min(k, logp.shape[-1]))
        # Candidates level by level: draft-vocabulary column, cumulative
        # log-probability, parent (global candidate index, -1: the root).
        cols, scores, parents = [top.indices], [top.values], [torch.full_like(top.indices, -1)]
        feat_in = root_feat.expand(top.indices.shape[0], -1)   # per candidate of the level
        src = None                                # expanded row of each candidate's parent
        anc = torch.zeros(0, 0, dtype=torch.bool, device=dev)  # ancestors among expanded rows
        ks, vs = [past_k], [past_v]
        offset = 0                                # global index of the level's first candidate
        for lvl in range(1, self.depth):
            sc = scores[-1]
            fr = sc.topk(min(self.beam, sc.shape[0])).indices   # the level's best: expand them
            b, e = fr.shape[0], anc.shape[0]
            if src is None:
                anc_new = torch.zeros(b, e, dtype=torch.bool, device=dev)
            else:
                s = src[fr]
                anc_new = anc[s] | F.one_hot(s, e).bool()
            # A frontier node sees the real pairs, its expanded ancestors, itself.
            mask = torch.cat([torch.ones(b, ctx, dtype=torch.bool, device=dev), anc_new,
                              torch.eye(b, dtype=torch.bool, device=dev)], dim=1)
            anc = torch.cat([torch.cat([anc, anc.new_zeros(e, b)], 1),
                             torch.cat([anc_new, anc.new_zeros(b, b)], 1)], 0)
            toks = self.token_ids(cols[-1][fr])
            pos = torch.full((b,), base - 1 + lvl, device=dev)
            f, kn, vn = self.head(self.embed(toks).to(dt), feat_in[fr], pos,
                                  (torch.cat(ks), torch.cat(vs)), mask)
            ks.append(kn), vs.append(vn)
            logp = torch.log_softmax(self.lm_head(f).float(), -1)
            top = logp.topk(min(k, logp.shape[-1]))              # [b, k]
            kk = top.indices.shape[1]
            cols.append(top.indices.flatten())
            scores.append((sc[fr][:, None] + top.values).flatten())
            parents.append((offset + fr).repeat_interleave(kk))
            feat_in = f.repeat_interleave(kk, dim=0)
            src = torch.arange(e, e + b, device=dev).repeat_interleave(kk)
            offset += sc.shape[0]
        levels = torch.cat([torch.full_like(c, i + 1) for i, c in enumerate(cols)])
        table = torch.stack([self.token_ids(torch.cat(cols)).double(), torch.cat(scores).double(),
                             torch.cat(parents).double(), levels.double()]).cpu().tolist()
        tok, score, par, level = table
        par = [int(p) for p in par]
        # Keep the best max_nodes; close under ancestors; order by level.
        keep = set(sorted(range(len(tok)), key=lambda c: (-score[c], level[c]))[:self.max_nodes])
        for c in list(keep):
            a = par[c]
            while a >= 0 and a not in keep:
                keep.add(a)
                a = par[a]
        order = sorted(keep, key=lambda c: (level[c], -score[c]))
        index = {c: j for j, c in enumerate(order)}
        return DraftTree(torch.tensor([int(tok[c]) for c in order], device=dev),
                         tuple(index[par[c]] if par[c] >= 0 else -1 for c in order))


@register_proposer("eagle")
def _make(spec, device, dtype, target=None, **_):
    from slipstream.spec.heads import DraftLMHead, read_draft_vocab, resolve_head
    path = resolve_head(spec.model, "eagle")
    head = EagleHead.load(path, device, dtype)
    lm_head = DraftLMHead(target, read_draft_vocab(path), dtype, device)
    from slipstream.spec import cpu_draft
    if cpu_draft.usable(head, device):      # drafting on a CPU: products on GGUF blocks
        lm_head = cpu_draft.quantize_head(head, lm_head)
    return EagleProposer(head, target.model.embed_tokens, lm_head,
                         spec.num_speculative_tokens, spec.eagle_topk, spec.eagle_beam,
                         spec.eagle_max_nodes)

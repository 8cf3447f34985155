"""Medusa: K extra heads on the target's last hidden state.

Head i (1-based) maps the hidden state h that chose the root (position
L - 2, see spec/base.py) to a guess at the token i places after the root:
    logits_i = lm_head(h + W2_i SiLU(W1_i h))
with the target's own frozen LM head. W2 starts at zero, so an untrained head
repeats the target's next-token guess. The draft tree is static: the
Cartesian product of each head's top-k (`topk[i]` for head i), nodes ordered
by depth so parents come first; drafts are deterministic (q one-hot).
"""
from __future__ import annotations

import itertools
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.spec.base import ProposeRequest, register_proposer
from slipstream.spec.tree import DraftTree


class MedusaHeads(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int):
        super().__init__()
        self.hidden_size, self.num_heads = hidden_size, num_heads
        self.w1 = nn.Parameter(torch.randn(num_heads, hidden_size, hidden_size) / hidden_size ** 0.5)
        self.w2 = nn.Parameter(torch.zeros(num_heads, hidden_size, hidden_size))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        # h: [n, hidden] (or the target's wider rows: their final hidden states)
        # -> per-head states [n, num_heads, hidden]
        x = h[..., :self.hidden_size].to(self.w1.dtype)
        inner = F.silu(torch.einsum("nh,khd->nkd", x, self.w1))
        return x.unsqueeze(1) + torch.einsum("nkd,kde->nke", inner, self.w2)

    def save(self, path: str | Path, draft_vocab: torch.Tensor | None = None) -> None:
        from safetensors.torch import save_file
        tensors = {"w1": self.w1.detach().half().contiguous(),
                   "w2": self.w2.detach().half().contiguous()}
        if draft_vocab is not None:
            tensors["draft_vocab"] = draft_vocab.to(torch.int32).contiguous()
        save_file(tensors, str(path), metadata={"kind": "medusa", "num_heads": str(self.num_heads)})

    @classmethod
    def load(cls, path: str | Path, device="cpu", dtype=torch.float32) -> "MedusaHeads":
        from safetensors.torch import load_file
        t = load_file(str(path))
        heads = cls(t["w1"].shape[1], t["w1"].shape[0])
        heads.w1.data, heads.w2.data = t["w1"].to(device, dtype), t["w2"].to(device, dtype)
        return heads.requires_grad_(False)


def static_tree(topk: tuple[int, ...]) -> tuple[tuple[int, ...], list[tuple[int, ...]]]:
    """The Cartesian-product tree: (parents, rank path of each node), nodes
    level by level. Node with rank path (r1, .., rd) holds head d's r_d-th token."""
    paths: list[tuple[int, ...]] = []
    for depth in range(1, len(topk) + 1):
        paths.extend(itertools.product(*(range(k) for k in topk[:depth])))
    index = {p: j for j, p in enumerate(paths)}
    parents = tuple(index[p[:-1]] if len(p) > 1 else -1 for p in paths)
    return parents, paths


def default_topk(num_heads: int) -> tuple[int, ...]:
    """Top-3 from the first head, top-2 from the second, top-1 after: a tree
    over every head the file holds (3 heads: 3 + 6 + 6 = 15 nodes)."""
    return ((3, 2) + (1,) * num_heads)[:num_heads]


class MedusaProposer:
    needs_hidden = True

    def __init__(self, heads: MedusaHeads, lm_head, topk: tuple[int, ...] | None = None):
        if topk is None:
            topk = default_topk(heads.num_heads)
        if len(topk) > heads.num_heads or min(topk, default=0) < 1:
            raise ValueError(f"medusa topk {topk}: one k >= 1 per head, at most "
                             f"{heads.num_heads} heads")
        self.heads, self.lm_head = heads, lm_head       # lm_head: as EagleProposer's
        self.token_ids = getattr(lm_head, "token_ids", lambda cols: cols)
        self.topk = tuple(topk)
        self.parents, paths = static_tree(self.topk)
        # Node j takes column (head d-1, rank r_d) of the flattened per-head top-k.
        width = max(self.topk)
        self.pick = torch.tensor([(len(p) - 1) * width + p[-1] for p in paths])

    @torch.inference_mode()
    def propose(self, requests: list[ProposeRequest]) -> list[DraftTree]:
        if not requests:
            return []
        tokens = self.propose_from_states(torch.stack([r.hidden[-1] for r in requests]))
        return [DraftTree(tokens[i], self.parents) for i in range(len(requests))]

    @torch.inference_mode()
    def draft_after_verify(self, rids, starts, hidden: torch.Tensor, base_rows: torch.Tensor,
                           out) -> tuple[torch.Tensor, list[bool]]:
        """Right after verification, before the round's one wait: the next
        trees' tokens [B, nodes] from the states that chose each request's
        last token (its root next round); they travel in the verifier's copy."""
        return self.propose_from_states(hidden[base_rows + out.last_row]), [True] * len(rids)

    def finish_drafts(self, rid: str, row: torch.Tensor, num_accepted: int) -> DraftTree:
        """row: the host copy of this request's `draft_after_verify` row."""
        return DraftTree(row, self.parents)

    @torch.inference_mode()
    def propose_from_states(self, h: torch.Tensor) -> torch.Tensor:
        """h: [B, hidden], the states that chose each root -> the tree's tokens
        [B, nodes] int64 on h's device (parents: `self.parents`)."""
        states = self.heads(h)[:, :len(self.topk)]                      # [B, depth, hidden]
        logits = self.lm_head(states.flatten(0, 1).to(h.dtype))         # [B * depth, V]
        top = logits.topk(max(self.topk), dim=-1).indices.view(h.shape[0], -1)
        if self.pick.device != top.device:
            self.pick = self.pick.to(top.device)    # once
        return self.token_ids(top[:, self.pick])                        # [B, nodes]

    def release(self, request_id: str) -> None:
        pass


@register_proposer("medusa")
def _make(spec, device, dtype, target=None, **_):
    from slipstream.spec.heads import DraftLMHead, read_draft_vocab, resolve_head
    path = resolve_head(spec.model, "medusa")
    heads = MedusaHeads.load(path, device, dtype)
    lm_head = DraftLMHead(target, read_draft_vocab(path), dtype, device)
    from slipstream.spec import cpu_draft
    if cpu_draft.usable(heads, device):        # a draft vocabulary's rows in the target's blocks
        lm_head = cpu_draft.quantize_lm_head(lm_head)
    return MedusaProposer(heads, lm_head, spec.medusa_topk)

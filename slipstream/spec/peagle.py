"""Parallel drafting (P-EAGLE / ParallelSpec): an EAGLE head that drafts all of a
round's tokens in one forward pass.

EAGLE drafts depth by depth, one head pass a level. Here, after the request's
real pairs (the head's K/V, as `EagleProposer` keeps them), the first draft
token d_1 comes from the head's feature after the root, as in EAGLE; then one
pass over K - 1 rows drafts the rest:

    row 0           (feature after the root, embed(d_1))   -> d_2
    row i (i >= 1)  (placeholder feature, placeholder token) -> d_{i+2}

at consecutive positions, each row seeing the real pairs and the rows before
it. The placeholders are two learned vectors of the head (`EagleShape.parallel`),
trained by `slipstream train-draft --method peagle`: its training-time-test
passes from the third on feed them instead of the head's own features and
the true tokens (spec/train.py), which is the context a placeholder row sees
when it drafts. The draft is a chain (greedy at every row), verified like
any other. A round costs the head two passes (the catch-up on the accepted
tokens and this one) whatever K is.
"""
from __future__ import annotations

import torch

from slipstream.spec.base import ProposeRequest, register_proposer
from slipstream.spec.eagle import EagleHead, EagleProposer, _append_mask, adapt_online, load_head
from slipstream.spec.tree import DraftTree


class ParallelExpander:
    """`EagleTreeExpander`'s interface: the candidate table of a chain of `depth`."""
    graphs_enabled = False   # eager only (no CUDA graphs for this pass yet)
    cpu_head = None          # kernels/cpu_eagle.CPUEagle: the pass in one C call (CPU)

    def __init__(self, head: EagleHead, embed, lm_head, token_ids, depth: int):
        if not head.shape.parallel:
            raise ValueError("speculative_method='peagle' needs a head trained for parallel "
                             "drafting (slipstream train-draft --method peagle)")
        self.head, self.embed, self.lm_head, self.token_ids = head, embed, lm_head, token_ids
        self.depth = depth

    def expand(self, root_feat: torch.Tensor, past_k: torch.Tensor, past_v: torch.Tensor,
               base: int | torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """root_feat: [hidden]; past_k, past_v: [C, kv_heads, head_dim] (`valid` [C]
        marks the real pairs; None: all); base: position of the first draft pair.
        Returns [4, depth] float64: token id, cumulative log-probability, parent
        (-1 for the first), level. Reads no host value."""
        dev, dt = root_feat.device, root_feat.dtype
        if valid is None:
            valid = torch.ones(past_k.shape[0], dtype=torch.bool, device=dev)
        logp = torch.log_softmax(self.lm_head(root_feat[None]), -1, dtype=torch.float32)
        scores, cols = logp.max(-1)                                       # [1] each
        n = self.depth - 1
        if n:
            h = self.head
            emb = torch.cat([self.embed(self.token_ids(cols)).to(dt),
                             h.mask_emb.to(dt).expand(n - 1, -1)])
            feat = torch.cat([root_feat[None], h.mask_feat.to(dt).expand(n - 1, -1)])
            pos = base + torch.arange(n, device=dev)
            if self.cpu_head is not None and not root_feat.is_cuda:
                f, _, _ = self.cpu_head.rows(emb, feat, pos, past_k, past_v, valid)
            else:
                f, _, _ = h(emb, feat, pos, (past_k, past_v), _append_mask(valid, n))
            lp = torch.log_softmax(self.lm_head(f), -1, dtype=torch.float32)
            s, c = lp.max(-1)                                             # [n] each
            scores, cols = torch.cat([scores, s]), torch.cat([cols, c])
        levels = torch.arange(1, self.depth + 1, device=dev, dtype=torch.float64)
        return torch.stack([self.token_ids(cols).double(), scores.cumsum(0).double(),
                            levels - 2, levels])


class ParallelEagleProposer(EagleProposer):
    """EAGLE's bookkeeping (the head's K/V per request, catch-up, drafting right
    after verification) with the parallel pass as the expansion."""

    def __init__(self, head: EagleHead, embed, lm_head, depth: int = 4):
        super().__init__(head, embed, lm_head, depth=depth, topk=1, beam=1, max_nodes=depth)
        self.expander = ParallelExpander(head, embed, lm_head, self.token_ids, depth)
        self.expander.cpu_head = self.cpu_head

    def propose(self, requests: list[ProposeRequest]) -> list[DraftTree]:
        """The chain cut to each request's draft budget (the auto-off rule shortens
        chains where long ones do not pay; the pass costs the same either way)."""
        trees = super().propose(requests)
        return [t if r.num_tokens is None or r.num_tokens >= t.num_nodes else
                DraftTree(t.tokens[:r.num_tokens], t.parents[:r.num_tokens])
                for t, r in zip(trees, requests)]


@register_proposer("peagle")
def _make(spec, device, dtype, target=None, **_):
    head, lm_head, path = load_head(spec, device, dtype, target, "peagle")
    return adapt_online(ParallelEagleProposer(head, target.model.embed_tokens, lm_head,
                                              spec.num_speculative_tokens), spec, path, device)

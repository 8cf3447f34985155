"""EAGLE: a one-layer draft head that runs autoregressively over the target's
features, with a dynamic draft tree (EAGLE-2). The head itself: spec/eagle_head.py.

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

import math

import numpy as np
import torch

from slipstream.kernels import cpu_eagle
from slipstream.kernels.cpu_eagle import CPUEagle
from slipstream.spec.base import ProposeRequest, register_proposer
from slipstream.spec.eagle_head import EagleHead, EagleShape  # noqa: F401 (re-exported)
from slipstream.spec.eagle_tree import EagleTreeExpander
from slipstream.spec.transfer import HostCopy, to_device
from slipstream.spec.tree import DraftTree


class EagleProposer:
    needs_hidden = True

    def __init__(self, head: EagleHead, embed, lm_head, depth: int = 5, topk: int = 4,
                 beam: int = 4, max_nodes: int = 16, min_prob: float = 0.0):
        """lm_head: features [n, hidden] -> logits [n, V'] (the target's LM head,
        or a `heads.DraftLMHead` over a draft vocabulary, whose `token_ids`
        maps columns to token ids). min_prob: candidates whose path's draft
        probability is lower are left out of the tree (its best one stays)."""
        if min(depth, topk, beam, max_nodes) < 1:
            raise ValueError("eagle depth, topk, beam and max_nodes must be at least 1")
        if not 0 <= min_prob < 1:
            raise ValueError(f"eagle min_prob must be in [0, 1), got {min_prob}")
        self.min_logp = math.log(min_prob) if min_prob > 0 else -math.inf
        self.head, self.embed, self.lm_head = head, embed, lm_head
        self.token_ids = getattr(lm_head, "token_ids", lambda cols: cols)
        self.depth, self.topk, self.beam, self.max_nodes = depth, topk, beam, max_nodes
        self.kv: dict[str, tuple[torch.Tensor, torch.Tensor, int]] = {}
        self.online = None     # spec/online.py: the head keeps training on what it sees
        self.expander = EagleTreeExpander(head, embed, lm_head, self.token_ids, depth, topk, beam)
        # On a CPU with the head on Q8_0 blocks: its rows and chains in one C call each
        # (adapt_online turns it off: online training rewrites the blocks it points into).
        self.cpu_head = (CPUEagle.build(head, lm_head, embed)
                         if head.device.type == "cpu" and cpu_eagle.enabled else None)
        self.expander.cpu_head = self.cpu_head

    def _head_rows(self, toks: torch.Tensor, feat: torch.Tensor, pos: torch.Tensor,
                   st: "_HeadContext | None"):
        """The head over new pairs that see the context's valid rows and, causally,
        each other -> (features, K, V)."""
        emb = self.embed(toks).to(self.head.dtype)
        if self.cpu_head is not None:
            return self.cpu_head.rows(emb, feat, pos, *((None,) * 3 if st is None else (st.k, st.v, st.valid)))
        return self.head(emb, feat, pos, None if st is None else (st.k, st.v),
                         None if st is None else _append_mask(st.valid, toks.shape[0]))

    def release(self, request_id: str) -> None:
        self.kv.pop(request_id, None)
        if self.online is not None:
            self.online.finish(request_id)

    def enable_graphs(self, on: bool) -> None:
        """Replay the tree expansion from CUDA graphs (GPU only; SpecConfig.draft_graphs)."""
        self.expander.graphs_enabled = on

    @torch.inference_mode()
    def propose(self, requests: list[ProposeRequest]) -> list[DraftTree]:
        trees = []
        for r in requests:
            root_feat, base = self._catch_up(r)
            st = self.kv[r.request_id]
            table = self.expander.expand(root_feat, st.k, st.v, base, st.valid)
            # The round's second wait (the first is the verifier's): the candidates.
            trees.append(self._select(HostCopy(table).wait()))
        return trees

    def _catch_up(self, r: ProposeRequest) -> tuple[torch.Tensor, int]:
        """Run the real pairs new since the last call; returns (f^ after the
        root, position of the first draft pair). The runner may hand over
        fewer states than the whole history (prefix-cache hits, speculation
        paused): a gap restarts the head's context at the first pair it is
        given, which only costs acceptance; states it has seen are skipped."""
        hidden, length = r.hidden, len(r.token_ids)
        first = length - 1 - hidden.shape[0]       # pairs j in [first, L - 1)
        st = self.kv.get(r.request_id)
        if st is not None and (st.end < first or first < st.start):
            st = None
        if st is not None and st.end > first:      # states sent twice: keep the first copy
            hidden, first = hidden[st.end - first:], st.end
        if st is not None and not hidden.shape[0]:
            return st.feat, length - 1
        dev = hidden.device
        toks = to_device(np.asarray(r.token_ids[first + 1:length]), torch.int64, dev)
        pos = torch.arange(first, length - 1, device=dev)
        t = hidden.shape[0]
        if self.online is not None:
            self.online.record(r.request_id, first, toks, hidden)
        f, k, v = self._head_rows(toks, self.head.target_feature(hidden), pos, st)
        if st is None:
            st = self.kv[r.request_id] = _HeadContext(k, v, torch.ones(t, dtype=torch.bool,
                                                                       device=dev), first)
        else:
            st.append(k, v, torch.ones(t, dtype=torch.bool, device=dev))
        st.end, st.feat = length - 1, f[-1]
        return f[-1], length - 1

    # ---- drafting right after verification, before the round's one wait ---------

    @torch.inference_mode()
    def draft_after_verify(self, rids: list[str], starts: list[int], hidden: torch.Tensor,
                           base_rows: torch.Tensor, out) -> tuple[torch.Tensor, list[bool]] | None:
        """Catch up on each request's root and accepted nodes and expand its
        next tree, all on the device (tokens, accepted count and positions
        read from the verifier's device output): the candidate table travels
        in the verifier's one copy. The D + 1 possible new pairs are all run;
        those past the accepted count stay in the head's K/V, masked off.
        Requests whose context does not end at the root (a gap) are left to
        `propose` (ok False)."""
        d1 = out.tokens.shape[1]
        rows, ok = [], []
        dev = hidden.device
        offs = torch.arange(d1, device=dev)
        for j, (rid, s) in enumerate(zip(rids, starts)):
            st = self.kv.get(rid)
            if st is None or st.end != s:
                ok.append(False)
                rows.append(None)
                continue
            a = out.num_accepted[j:j + 1]                                # [1] device
            path_rows = torch.cat([a.new_zeros(1), out.accepted_nodes[j] + 1]).clamp_min(0)
            h = hidden[base_rows[j] + path_rows]                         # [D + 1, hidden]
            toks = out.tokens[j].clamp_min(0)
            f, k, v = self._head_rows(toks, self.head.target_feature(h), s + offs, st)
            st.append(k, v, offs <= a)
            if self.online is not None:
                self.online.record(rid, s, toks, h, offs <= a)
            st.end, st.feat = None, f.index_select(0, a)[0]              # end: set by finish
            st.pending = (s + 1, d1)
            table = self.expander.expand(st.feat, st.k, st.v, s + 1 + a[0], st.valid)
            # A copy: the next request's replay rewrites the graph's output buffer.
            rows.append(table.reshape(-1).view(torch.int64).clone())
            ok.append(True)
        if not any(ok):
            return None
        width = next(r.shape[0] for r in rows if r is not None)
        filler = torch.zeros(width, dtype=torch.int64, device=dev)
        return torch.stack([filler if r is None else r for r in rows]), ok

    def finish_drafts(self, rid: str, row: torch.Tensor, num_accepted: int) -> DraftTree:
        """row: the host copy of this request's `draft_after_verify` row."""
        st = self.kv[rid]
        (first, d1), a = st.pending, num_accepted
        st.end = first + a
        # The rejected pairs are the last rows: drop them (views, no copy).
        n = st.k.shape[0] - (d1 - a - 1)
        st.k, st.v, st.valid = st.k[:n], st.v[:n], st.valid[:n]
        return self._select(row.view(torch.float64).view(4, -1))

    def _select(self, table: torch.Tensor) -> DraftTree:
        """table: the host candidate table [4, C] -> the tree of the best max_nodes."""
        tok, score, par, level = table.numpy()
        # Keep the best max_nodes (ties: shallower first), those at min_prob or above
        # (at least one); close under ancestors (a child never scores above its
        # parent, so this rarely adds any).
        n = self.max_nodes
        if self.min_logp > -math.inf:
            n = min(n, max(1, int((score >= self.min_logp).sum())))
        keep = set(np.lexsort((level, -score))[:n].tolist())
        parent = par.astype(np.int64).tolist()
        for c in list(keep):
            a = parent[c]
            while a >= 0 and a not in keep:
                keep.add(a)
                a = parent[a]
        kept = np.array(sorted(keep), dtype=np.int64)
        order = kept[np.lexsort((-score[kept], level[kept]))].tolist()   # by level, then score
        index = {c: j for j, c in enumerate(order)}
        return DraftTree(torch.from_numpy(tok[order].astype(np.int64)),
                         tuple(index[parent[c]] if parent[c] >= 0 else -1 for c in order))


class _HeadContext:
    """The pairs one request's head has seen: K, V [rows, kv_heads, head_dim]
    with `valid` [rows] marking real pairs (rows run after verification but
    past the accepted count are masked, not removed), from position `start`;
    `end`: the next pair's position; `feat`: f^ after the last real pair."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, start: int):
        self.k, self.v, self.valid, self.start = k, v, valid, start
        self.end: int | None = None
        self.feat: torch.Tensor | None = None
        self.pending = (0, 0)      # (first new position + 1, rows run) of a round in flight

    def append(self, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor) -> None:
        self.k, self.v = torch.cat([self.k, k]), torch.cat([self.v, v])
        self.valid = torch.cat([self.valid, valid])


def _append_mask(valid: torch.Tensor, t: int) -> torch.Tensor:
    """[t, C + t] bool: t new rows see the valid past and, causally, each other."""
    causal = torch.ones(t, t, dtype=torch.bool, device=valid.device).tril()
    return torch.cat([valid.expand(t, -1), causal], 1)


def load_head(spec, device, dtype, target, kind: str):
    """The named (or shipped) head file of `kind` -> (EagleHead, the LM head it drafts
    with, the file's path)."""
    from slipstream.spec.heads import DraftLMHead, read_draft_vocab, resolve_head
    path = resolve_head(spec.model, kind)
    head = EagleHead.load(path, device, dtype)
    target.set_feature_taps(head.shape.taps)   # EAGLE-3 heads read the target's layers
    lm_head = DraftLMHead(target, read_draft_vocab(path), dtype, device)
    from slipstream.spec import cpu_draft
    if cpu_draft.usable(head, device):      # drafting on a CPU: products on GGUF blocks
        shipped = spec.model is None and kind == "eagle"     # measured at 4 bits (cpu_draft)
        lm_head = cpu_draft.quantize_head(head, lm_head, cpu_draft.draft_bits(shipped))
    return head, lm_head, path


def adapt_online(proposer: "EagleProposer", spec, path, device) -> "EagleProposer":
    """Attach online adaptation (spec/online.py) where the config asks for it."""
    if spec.online:
        from slipstream.spec.online import OnlineAdapter
        proposer.online = OnlineAdapter(proposer.head, EagleHead.load(path, device, torch.float32),
                                        proposer.embed, proposer.lm_head, lr=spec.online_lr,
                                        every=spec.online_every)
        proposer.cpu_head = proposer.expander.cpu_head = None   # the head's blocks change
    return proposer


@register_proposer("eagle")
def _make(spec, device, dtype, target=None, **_):
    head, lm_head, path = load_head(spec, device, dtype, target, "eagle")
    return adapt_online(EagleProposer(head, target.model.embed_tokens, lm_head,
                                      spec.num_speculative_tokens, spec.eagle_topk,
                                      spec.eagle_beam, spec.eagle_max_nodes,
                                      spec.draft_min_prob), spec, path, device)

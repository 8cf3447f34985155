"""The pure parts of an EAGLE loop round (spec/eagle_loop.py), between its
writes to state: tree selection, greedy acceptance, the head over the new
pairs. Pure, so that torch.compile can fuse their small ops."""
from __future__ import annotations

import torch

from slipstream.kernels.tree_attention import pack_tree_mask

def first_by_rank(key: torch.Tensor, n: int) -> torch.Tensor:
    """The indices of key's n largest values, largest first, ties to the lower index:
    `key.sort(descending=True, stable=True).indices[:n]` without a sort (one [C, C]
    comparison that torch.compile fuses, where the stable sort of the tree's candidates
    was a radix sort of ~33 us a round on the H200, benchmarks/spec/README.md)."""
    c = key.shape[0]
    idx = torch.arange(c, device=key.device)
    before = (key[None, :] > key[:, None]) | ((key[None, :] == key[:, None]) & (idx[None, :] < idx[:, None]))
    rank = before.sum(1)                                       # [c]: 0 = first
    out = torch.zeros(n + 1, dtype=torch.int64, device=key.device)
    return out.scatter(0, torch.where(rank < n, rank, n), idx)[:n]   # slot n: the rest


class LoopParts:
    """Mixin of EagleLoop (reads depth, nodes, rows, head, embed, slot_of)."""

    def _tree(self, table: torch.Tensor, root: torch.Tensor):
        """table [4, C] -> root + tree: tokens, parent rows, depths [t], ancestor mask [t, t]
        (the best nodes by score, ties: shallower first; ordered by level then score)."""
        d, nn, t = self.depth, self.nodes, self.nodes + 1
        rows = self.rows
        tok_c, score, par, level = table
        key = score - 1e-6 * level
        sel = first_by_rank(key, nn)
        nodes = sel[first_by_rank(score[sel] - level[sel] * 1e6, nn)]
        where = torch.zeros(tok_c.shape[0], dtype=torch.int64, device=table.device)
        where = where.scatter(0, nodes, rows[1:])                  # candidate -> row
        p = par[nodes].long()
        prow = torch.cat([rows[:1], torch.where(p >= 0, where[p.clamp_min(0)], 0)])   # [t]
        depth = torch.cat([rows[:1], level[nodes].long()])                             # [t]
        tokens = torch.cat([root.view(1), tok_c[nodes].long()])                        # [t]
        anc = torch.zeros(t, t, dtype=torch.bool, device=table.device)   # ancestors, self
        cur = rows
        for _ in range(d + 1):
            anc = anc.scatter(1, cur[:, None], True)
            cur = prow[cur]
        return tokens, prow, depth, anc

    def _feed(self, tokens, depth, anc, n, ids, pos, slots, ctx, seq, bits):
        """Write the target step's inputs for root + tree into the batch's buffers
        (ids, positions, slots [t]; context and sequence length [1] int32; the
        ancestor mask packed to bits [1, t]); compiled, a kernel or two instead of
        one per buffer."""
        t = tokens.shape[0]
        ids.copy_(tokens)
        pos.copy_(n + depth)
        slots.copy_(self.slot_of[n + self.rows])
        ctx.copy_(n.view(1))
        seq.copy_((n + t).view(1))
        bits.copy_(pack_tree_mask(anc[None]))

    def _accept(self, tokens, am, prow, depth, anc, n):
        """-> accepted count, last accepted row, path [D] (node rows - 1, -1 pad),
        emitted tokens [D + 1] (-1 pad), and the KV slots the accepted path moves
        from and to (the slots after the root; rows past the count stay)."""
        d, rows = self.depth, self.rows
        wrong = (tokens != am[prow]) & (rows > 0)
        good = ~(anc & wrong[None]).any(1) & (rows > 0)
        a = good.sum()
        last = torch.where(good, rows, 0).amax()
        path = torch.full((d + 1,), -1, dtype=torch.int64, device=tokens.device)
        path = path.scatter(0, torch.where(good, depth - 1, d), rows - 1)[:d]
        emitted = torch.cat([torch.where(path >= 0, tokens[(path + 1).clamp_min(0)], -1),
                             path.new_full((1,), -1)])
        emitted = emitted.scatter(0, a.view(1), am.index_select(0, last.view(1)))
        dst = n + 1 + rows[:d]
        src = torch.where(rows[:d] < a, n + 1 + path, dst)
        return a, last, path, emitted, self.slot_of[src], self.slot_of[dst]

    def _commit(self, a, last, am, emitted, feat, k, v, valid, hk, hv, hvalid, hptr, feat_s,
                root, n, ring, rix):
        """The round's state writes: the head's new K/V pairs, the feature and root
        of the next round, the context length, the ring's entry (count, tokens)."""
        at = hptr + self.rows[:self.depth + 1]
        hk.index_copy_(0, at, k)
        hv.index_copy_(0, at, v)
        hvalid.index_copy_(0, at, valid)
        hptr.add_(a + 1)
        feat_s.copy_(feat)
        root.copy_(am.index_select(0, last.view(1))[0])
        n.add_(a + 1)
        ring.index_copy_(0, rix.view(1), torch.cat([(a + 1).view(1), emitted])[None])
        rix.add_(1)

    def _pairs(self, hidden, path, emitted, a, n, hk, hv, hvalid):
        """The head over the D + 1 possible new pairs -> f^ after the last real one,
        their K, V and validity (past the accepted count: masked)."""
        d, rows = self.depth, self.rows
        offs = rows[:d + 1]
        dt = self.head.dtype
        h = hidden[torch.cat([rows[:1], path + 1]).clamp_min(0)]       # [d + 1, hidden]
        causal = torch.ones(d + 1, d + 1, dtype=torch.bool, device=hidden.device).tril()
        mask = torch.cat([hvalid.expand(d + 1, -1), causal], 1)
        f, k, v = self.head(self.embed(emitted.clamp_min(0)).to(dt), self.head.target_feature(h), n + offs,
                            (hk, hv), mask)
        return f.index_select(0, a.view(1))[0], k, v, offs <= a

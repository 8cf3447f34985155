"""Draft trees: the tokens a proposer suggests after a request's last token.

A tree's root is the request's last token (already chosen, not yet in the KV
cache); its nodes are draft tokens. Node j (0-based) has parent `parents[j]`
(-1: the root) and parents come before children, so a chain of k tokens is
the one-branch tree with parents [-1, 0, 1, ..., k-2].

Verification runs the root and the nodes in one target forward. In that
forward, query row 0 is the root and row j + 1 is node j; row r sits at
position context_len + depth(r) (the root has depth 0) and writes its K/V to
slot context_len + r, and sees the context plus its own ancestors
(`ancestor_mask`). After verification the accepted path's K/V move to slots
context_len + 1 .. context_len + accepted (`kv_moves`); for a chain the path
already sits there and nothing moves.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(frozen=True)
class DraftTree:
    """tokens: [n] int64 draft tokens; parents: n host ints (-1 = the root).
    draft_probs: optional [n, vocab] float32, row j = the distribution q that
    node j's token was drawn from. Siblings drawn with draft_probs must be
    independent draws from their parent's q (what the verifier's residual
    update assumes); None means the drafts are deterministic (argmax, top-k,
    n-gram lookup), which the verifier treats as q = one-hot(token).
    """
    tokens: torch.Tensor
    parents: tuple[int, ...]
    draft_probs: torch.Tensor | None = None
    depths: tuple[int, ...] = field(init=False)

    def __post_init__(self):
        parents = tuple(int(p) for p in self.parents)
        object.__setattr__(self, "parents", parents)
        if self.tokens.dim() != 1 or self.tokens.shape[0] != len(parents):
            raise ValueError(f"tokens must be [num_nodes={len(parents)}], "
                             f"got {tuple(self.tokens.shape)}")
        depths = []
        for j, p in enumerate(parents):
            if not -1 <= p < j:
                raise ValueError(f"parents[{j}] = {p}: a parent must be -1 or an earlier node")
            depths.append(1 if p < 0 else depths[p] + 1)
        object.__setattr__(self, "depths", tuple(depths))
        if self.draft_probs is not None and (
                self.draft_probs.dim() != 2 or self.draft_probs.shape[0] != len(parents)):
            raise ValueError(f"draft_probs must be [num_nodes={len(parents)}, vocab], "
                             f"got {tuple(self.draft_probs.shape)}")

    @classmethod
    def chain(cls, tokens, draft_probs: torch.Tensor | None = None) -> "DraftTree":
        tokens = torch.as_tensor(tokens, dtype=torch.int64).flatten()
        return cls(tokens, tuple(range(-1, tokens.shape[0] - 1)), draft_probs)

    @classmethod
    def empty(cls, device: torch.device | str = "cpu") -> "DraftTree":
        return cls(torch.zeros(0, dtype=torch.int64, device=device), ())

    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    @property
    def depth(self) -> int:
        return max(self.depths, default=0)

    @property
    def is_chain(self) -> bool:
        return all(p == j - 1 for j, p in enumerate(self.parents))

    @property
    def max_children(self) -> int:
        counts = np.bincount(np.asarray(self.parents, dtype=np.int64) + 1, minlength=1)
        return int(counts.max()) if self.num_nodes else 0

    def positions(self, context_len: int) -> list[int]:
        """Positions of the verification rows (root first)."""
        return [context_len] + [context_len + d for d in self.depths]

    def ancestor_mask(self, device: torch.device | str | None = None) -> torch.Tensor:
        """[n + 1, n + 1] bool over the verification rows (row 0 = root):
        row r marks r and its ancestors; usable as one request's
        `ForwardBatch.tree_mask` slice."""
        return torch.from_numpy(ancestor_array(self.parents).copy()).to(
            device or self.tokens.device)

    def path_to(self, node: int) -> list[int]:
        """Nodes from the root's child down to `node` (inclusive)."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def kv_moves(self, accepted: list[int]) -> list[tuple[int, int]]:
        """(from_row, to_row) pairs that bring the accepted path's K/V (row
        node + 1 of the verification) to rows 1..len(accepted); rows already in
        place are left out, so a chain needs none."""
        return [(node + 1, d + 1) for d, node in enumerate(accepted) if node != d]


def tree_mask_batch(trees: list[DraftTree], device: torch.device | str) -> torch.Tensor:
    """[num_seqs, max_rows, max_rows] bool for a step of tree verifications
    (rows = nodes + 1); padding rows see only themselves."""
    width = max(t.num_nodes + 1 for t in trees)
    out = torch.eye(width, dtype=torch.bool).repeat(len(trees), 1, 1)
    for i, t in enumerate(trees):
        out[i, :t.num_nodes + 1, :t.num_nodes + 1] = t.ancestor_mask("cpu")
    return out.to(device)


@dataclass
class TreeBatch:
    """Trees of several requests padded to one shape, for the verifier.

    tokens: [B, N + 1] int64, column 0 unused (the root), column j + 1 = node j
    children: [B, N + 1, K] int64, the verification rows of row r's children in
        order, 0 where there are fewer (row 0, the root, is nobody's child)
    draft_probs: [B, N + 1, V] float32 or None (all deterministic); rows of
        requests without q hold one-hot drafts
    num_nodes: host ints; depth, max_children: host ints bounding the loops.
    parent_rows, depths: [B, N + 1] int64, each row's parent row (0 for the
        root and padding) and depth (0 for the root and padding);
    relations: [B, 2, N + 1, N + 1] uint8: [:, 0] row r' is an ancestor of r
        or r itself (the root left out), [:, 1] r' is an earlier sibling of r.
        These three let greedy verification run without a loop over depth;
        None (hand-built batches) falls back to the walk.
    """
    tokens: torch.Tensor
    children: torch.Tensor
    draft_probs: torch.Tensor | None
    num_nodes: list[int]
    depth: int
    max_children: int
    parent_rows: torch.Tensor | None = None
    depths: torch.Tensor | None = None
    relations: torch.Tensor | None = None

    @classmethod
    def stack(cls, trees: list[DraftTree], device: torch.device | str,
              vocab_size: int | None = None) -> "TreeBatch":
        """Trees whose tokens are on the host are packed with numpy and reach
        the device in one copy that does not wait (spec/transfer.py)."""
        from slipstream.spec.transfer import to_device
        b = len(trees)
        n = max((t.num_nodes for t in trees), default=0)
        k = max((t.max_children for t in trees), default=0)
        children = np.zeros((b, n + 1, max(k, 1)), dtype=np.int64)
        host = all(t.tokens.device.type == "cpu" for t in trees)
        tok = np.zeros((b, n + 1), dtype=np.int64)
        prow = np.zeros((b, n + 1), dtype=np.int64)
        dep = np.zeros((b, n + 1), dtype=np.int64)
        rel = np.zeros((b, 2, n + 1, n + 1), dtype=np.uint8)
        for i, t in enumerate(trees):
            m = t.num_nodes + 1
            if host and t.num_nodes:
                tok[i, 1:m] = t.tokens.numpy()
            kids, p_r, d_r, r_r = _structure(t.parents)
            children[i, :kids.shape[0], :kids.shape[1]] = kids
            prow[i, :m], dep[i, :m], rel[i, :, :m, :m] = p_r, d_r, r_r
        flat = to_device(np.concatenate([tok.ravel(), prow.ravel(), dep.ravel(),
                                         children.ravel()]), torch.int64, device)
        relations = to_device(rel, torch.uint8, device)
        c = tok.size
        tokens = flat[:c].view(b, n + 1)
        if not host:
            tokens = tokens.clone()
            for i, t in enumerate(trees):
                if t.num_nodes:
                    tokens[i, 1:t.num_nodes + 1] = t.tokens.to(device)
        probs = None
        if any(t.draft_probs is not None for t in trees):
            v = vocab_size or next(t.draft_probs.shape[1] for t in trees
                                   if t.draft_probs is not None)
            probs = torch.zeros(b, n + 1, v, dtype=torch.float32, device=device)
            for i, t in enumerate(trees):
                if not t.num_nodes:
                    continue
                if t.draft_probs is not None:
                    probs[i, 1:t.num_nodes + 1] = t.draft_probs.to(device, torch.float32)
                else:
                    probs[i, torch.arange(1, t.num_nodes + 1, device=device),
                          t.tokens.to(device)] = 1.0
        return cls(tokens, flat[3 * c:].view(b, n + 1, max(k, 1)), probs,
                   [t.num_nodes for t in trees], max((t.depth for t in trees), default=0), k,
                   flat[c:2 * c].view(b, n + 1), flat[2 * c:3 * c].view(b, n + 1), relations)


_STRUCTURE: dict[tuple[int, ...], tuple] = {}


def _structure(parents: tuple[int, ...]) -> tuple:
    """(children [n + 1, K], parent rows [n + 1], depths [n + 1], relations
    [2, n + 1, n + 1] uint8) of one tree, as `TreeBatch` lays them out
    (memoised: static trees and chains repeat every step)."""
    out = _STRUCTURE.get(parents)
    if out is None:
        n = len(parents)
        kids = _children_of(parents)
        prow = np.array([0] + [p + 1 for p in parents], dtype=np.int64)
        dep = np.zeros(n + 1, dtype=np.int64)
        rel = np.zeros((2, n + 1, n + 1), dtype=np.uint8)
        rel[0] = ancestor_array(parents)
        rel[0, :, 0] = 0
        for j, p in enumerate(parents):
            dep[j + 1] = dep[p + 1] + 1
            for sib in kids[p + 1]:
                if 0 < sib < j + 1:
                    rel[1, j + 1, sib] = 1
        if len(_STRUCTURE) > 4096:
            _STRUCTURE.clear()
        out = _STRUCTURE[parents] = (kids, prow, dep, rel)
    return out


_CHILDREN: dict[tuple[int, ...], np.ndarray] = {}
_ANCESTORS: dict[tuple[int, ...], np.ndarray] = {}


def ancestor_array(parents: tuple[int, ...]) -> np.ndarray:
    """`DraftTree.ancestor_mask` as a read-only numpy array [n + 1, n + 1]
    (memoised like `_children_of`)."""
    mask = _ANCESTORS.get(parents)
    if mask is None:
        n = len(parents)
        mask = np.zeros((n + 1, n + 1), dtype=bool)
        mask[:, 0] = True
        for j, p in enumerate(parents):
            mask[j + 1] = mask[p + 1]
            mask[j + 1, j + 1] = True
        mask.flags.writeable = False
        if len(_ANCESTORS) > 4096:
            _ANCESTORS.clear()
        _ANCESTORS[parents] = mask
    return mask


def _children_of(parents: tuple[int, ...]) -> np.ndarray:
    """[n + 1, K] int64: the verification rows of row r's children in order,
    0 where fewer (memoised: static trees and chains repeat every step)."""
    kids = _CHILDREN.get(parents)
    if kids is None:
        n = len(parents)
        counts = np.bincount(np.asarray(parents, dtype=np.int64) + 1, minlength=n + 1)
        kids = np.zeros((n + 1, max(int(counts.max()) if n else 0, 1)), dtype=np.int64)
        fill = np.zeros(n + 1, dtype=np.int64)
        for j, p in enumerate(parents):
            kids[p + 1, fill[p + 1]] = j + 1
            fill[p + 1] += 1
        if len(_CHILDREN) > 4096:
            _CHILDREN.clear()
        _CHILDREN[parents] = kids
    return kids

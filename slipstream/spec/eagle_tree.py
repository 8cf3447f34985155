"""EAGLE-2's tree expansion, eagerly or replayed from a CUDA graph.

From the head's feature after the root and its K/V of the request's real
pairs, `depth` levels: level 1 holds the top-k tokens after the root; each
later level runs the head once over the `beam` candidates of highest
cumulative draft log-probability and takes the top-k children of each. The
result is the candidate table [4, C] float64 (token id, cumulative
log-probability, parent candidate index (-1: the root), level) that
`EagleProposer` turns into a tree.

Every shape here depends only on (depth, topk, beam) and the length of the
past, so on a GPU (opt-in: `speculative_draft_graphs`) the levels (about 40
small kernels each, launch-bound) are captured once per past-length class (a
power of two >= 256): the request's past K/V are copied into a static
buffer of that length and the rows beyond it masked off. Each new graph is checked once against the eager expansion of
the same inputs; on any difference or capture error graphs switch off with a
warning and the eager path runs.
"""
from __future__ import annotations

import warnings
from typing import NamedTuple

import torch

from slipstream.kernels.cpu_eagle import chain_table


# Rows at least this long take `row_topk`'s two stages on a GPU.
TWO_STAGE_MIN = 4096
# On a GPU a stage over rows of at most SORT_MAX values sorts them and keeps the first
# k, instead of torch.topk (radix selection in several passes, ~12 us a call in the
# H200 kernel profile of a round). Measured on the H200 (benchmarks/spec/README.md, "The
# compiled round"): eagerly, sorting the 128-value pieces of the first stage pays and
# sorting the second stage's 1,024 values does not; under torch.compile (the EAGLE
# loop's `compile_expansion`, whose expander sets `sort_max`) sorting both pays.
SORT_MAX = 128
COMPILED_SORT_MAX = 2048
# On a GPU a level's log-softmax and top-k run as kernels/logp_topk.py's two launches
# (False: log_softmax, then row_topk). H200, compiled EAGLE round: 1.430 ms against
# 1.516 (benchmarks/spec/README.md).
FUSED_LOGP_TOPK = True


class TopK(NamedTuple):
    values: torch.Tensor
    indices: torch.Tensor


def row_topk(x: torch.Tensor, k: int, stages: int | None = None,
             sort_max: int | None = None) -> TopK:
    """torch.topk(x, k) over the last dim (values, indices; values descending). On a GPU a
    long row goes in two stages: the top k of each of ~sqrt(n) pieces, then the top k of
    those. torch.topk gives a row one thread block, so a row of the draft vocabulary
    (16,384 log-probabilities) took ~85 us on the H200 (a round's kernel profile,
    benchmarks/spec/README.md) where its pieces fill the GPU. Which of equal values is
    kept may differ from torch.topk's choice (neither is specified). stages: 1 or 2 to
    force either way (None: two for such rows on a GPU).
    sort_max: stages over rows of at most this many values by a sort (0: none; None:
    SORT_MAX on a GPU, else 0)."""
    n = x.shape[-1]
    if sort_max is None:
        sort_max = SORT_MAX if x.is_cuda else 0
    if stages is None:
        stages = 2 if x.is_cuda and n >= TWO_STAGE_MIN and k <= 64 else 1
    if stages == 1:
        return _top(x, k, sort_max)
    piece = 1 << ((n.bit_length() + 1) // 2)            # ~sqrt(n), a power of two
    pad = -n % piece
    if pad:
        x = torch.nn.functional.pad(x, (0, pad), value=float("-inf"))
    first = _top(x.unflatten(-1, (-1, piece)), min(k, piece), sort_max)        # [..., pieces, k']
    base = torch.arange(0, x.shape[-1], piece, device=x.device)[:, None]
    cand = (first.indices + base).flatten(-2)
    second = _top(first.values.flatten(-2), k, sort_max)
    return TopK(second.values, cand.gather(-1, second.indices))


def logp_top(logits: torch.Tensor, k: int, sort_max: int | None = None) -> TopK:
    """The top k of log_softmax(logits) over the last dim of [rows, n] logits: values
    (fp32 log-probabilities, descending) and indices."""
    if logits.is_cuda and FUSED_LOGP_TOPK:
        from slipstream.kernels import logp_topk
        if k <= logp_topk.MAX_K:
            return TopK(*logp_topk.logp_topk_op(logits, k))
    logp = torch.log_softmax(logits, -1, dtype=torch.float32)
    return row_topk(logp, k, sort_max=sort_max)


def _top(x: torch.Tensor, k: int, sort_max: int) -> TopK:
    """torch.topk over the last dim, or for rows of at most sort_max values a descending
    sort cut to k: the same values, ties possibly in another order."""
    if x.shape[-1] <= sort_max:
        s = x.sort(-1, descending=True)
        return TopK(s.values[..., :k], s.indices[..., :k])
    return TopK(*x.topk(k))


class EagleTreeExpander:
    def __init__(self, head, embed, lm_head, token_ids, depth: int, topk: int, beam: int):
        self.head, self.embed, self.lm_head, self.token_ids = head, embed, lm_head, token_ids
        self.depth, self.topk, self.beam = depth, topk, beam
        self.graphs: dict[int, tuple] = {}       # past length class -> (graph, inputs, table)
        # On a GPU only; opt-in (SpecConfig.draft_graphs) until measured there.
        self.graphs_enabled = False
        self.pool = None
        self._consts: dict[tuple, torch.Tensor] = {}
        self.cpu_head = None     # kernels/cpu_eagle.CPUEagle: a chain (beam 1) in one C call
        self.sort_max: int | None = None   # row_topk's; the compiled loop sets COMPILED_SORT_MAX

    def expand(self, root_feat: torch.Tensor, past_k: torch.Tensor, past_v: torch.Tensor,
               base: int | torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """root_feat: [hidden]; past_k, past_v: [C, kv_heads, head_dim], of which
        `valid` [C] bool marks the real pairs (None: all); base: absolute
        position of the first draft pair (an int or a 0-dim device tensor).
        Returns the candidate table [4, num_candidates] float64 on the device
        (a graph's output buffer: valid until the next call). Reads no host value."""
        dev = root_feat.device
        if valid is None:
            valid = torch.ones(past_k.shape[0], dtype=torch.bool, device=dev)
        if self.cpu_head is not None and self.beam == 1 and not root_feat.is_cuda:
            tokens, logp = self.cpu_head.chain(root_feat, past_k, past_v, valid, int(base),
                                               self.depth, self.topk)
            return chain_table(tokens, logp)
        if not torch.is_tensor(base):
            base = torch.full((), base, dtype=torch.int64, device=dev)
        if root_feat.is_cuda and self.graphs_enabled:
            table = self._replay(root_feat, past_k, past_v, base, valid)
            if table is not None:
                return table
        return self.levels(root_feat, past_k, past_v, valid, base)

    def levels(self, root_feat: torch.Tensor, past_k: torch.Tensor, past_v: torch.Tensor,
               valid: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        """The expansion over a past of which `valid` [C] bool marks the real
        rows; base: 0-dim int64 tensor. No host value is read."""
        dt, dev = root_feat.dtype, root_feat.device
        ctx = past_k.shape[0]
        k = self.topk
        logits = self.lm_head(root_feat[None])
        top = logp_top(logits, min(k, logits.shape[-1]), self.sort_max)
        top = TopK(top.values[0], top.indices[0])
        # Candidates level by level: draft-vocabulary column, cumulative
        # log-probability, parent (global candidate index, -1: the root).
        const = self._const
        cols, scores, parents = [top.indices], [top.values], [
            const(("full", top.indices.shape[0], -1), lambda n, fill: torch.full((n,), fill, device=dev))]
        feat_in = root_feat.expand(top.indices.shape[0], -1)   # per candidate of the level
        src = None                                # expanded row of each candidate's parent
        anc = torch.zeros(0, 0, dtype=torch.bool, device=dev)  # ancestors among expanded rows
        ks, vs = [past_k], [past_v]
        offset = 0                                # global index of the level's first candidate
        for lvl in range(1, self.depth):
            sc = scores[-1]
            # The level's best: expand them. A sort of these few dozen values, not topk
            # (top-k kernels of ~85 us in an H200 profile of a round; compiled, this sort
            # fuses into a kernel of ~2 us).
            fr = sc.sort(descending=True, stable=True).indices[:min(self.beam, sc.shape[0])]
            b, e = fr.shape[0], anc.shape[0]
            # Shape-only tensors are made once (no launches in a replayed graph).
            def zeros(r: int, c: int) -> torch.Tensor:
                return const(("zeros", r, c), lambda *_: torch.zeros(r, c, dtype=torch.bool,
                                                                       device=dev))
            if src is None:
                anc_new = zeros(b, e)
            else:
                s = src[fr]
                anc_new = anc[s] | (s[:, None] == const(("arange", 0, e), lambda *_: torch.arange(
                    e, device=dev)))
            # A frontier node sees the real pairs, its expanded ancestors, itself.
            mask = torch.cat([valid.expand(b, ctx), anc_new, const(("eye", b), lambda *_: torch.eye(
                b, dtype=torch.bool, device=dev))], dim=1)
            anc = torch.cat([torch.cat([anc, zeros(e, b)], 1), torch.cat([anc_new, zeros(b, b)], 1)], 0)
            toks = self.token_ids(cols[-1][fr])
            pos = (base + (lvl - 1)).expand(b)
            f, kn, vn = self.head(self.embed(toks).to(dt), feat_in[fr], pos,
                                  (ks, vs), mask)
            ks.append(kn), vs.append(vn)
            logits = self.lm_head(f)
            top = logp_top(logits, min(k, logits.shape[-1]), self.sort_max)              # [b, k]
            kk = top.indices.shape[1]
            cols.append(top.indices.flatten())
            scores.append((sc[fr][:, None] + top.values).flatten())
            parents.append((offset + fr).repeat_interleave(kk))
            feat_in = f.repeat_interleave(kk, dim=0)
            src = const(("src", e, b, kk), lambda *_: torch.arange(
                e, e + b, device=dev).repeat_interleave(kk))
            offset += sc.shape[0]
        levels = const(("levels",) + tuple(c.shape[0] for c in cols), lambda *_: torch.cat(
            [torch.full_like(c, i + 1) for i, c in enumerate(cols)]))
        return torch.stack([self.token_ids(torch.cat(cols)).double(), torch.cat(scores).double(),
                            torch.cat(parents).double(), levels.double()])

    def _const(self, key: tuple, make) -> torch.Tensor:
        """A tensor that depends only on shapes, made once (never written to)."""
        t = self._consts.get(key)
        if t is None:
            t = self._consts[key] = make(*key[1:])
        return t

    # ---- CUDA graphs ----------------------------------------------------------------

    def _replay(self, root_feat, past_k, past_v, base, valid) -> torch.Tensor | None:
        ctx = past_k.shape[0]
        length = max(256, 1 << max(ctx - 1, 0).bit_length())
        entry = self.graphs.get(length)
        if entry is None:
            try:
                entry = self._capture(root_feat, past_k, past_v, base, valid, length)
            except Exception as e:   # noqa: BLE001 - the eager expansion stays correct
                warnings.warn(f"CUDA graphs for EAGLE drafting are off: {e!r}")
                self.graphs_enabled = False
                return None
            self.graphs[length] = entry
            return entry[2]
        graph, inputs, table = entry
        self._fill(inputs, root_feat, past_k, past_v, base, valid)
        graph.replay()
        return table

    @staticmethod
    def _fill(inputs: dict, root_feat, past_k, past_v, base, valid) -> None:
        ctx = past_k.shape[0]
        inputs["root"].copy_(root_feat)
        inputs["k"][:ctx].copy_(past_k)
        inputs["v"][:ctx].copy_(past_v)
        inputs["valid"][ctx:].fill_(False)
        inputs["valid"][:ctx].copy_(valid)
        inputs["base"].copy_(base)

    def _capture(self, root_feat, past_k, past_v, base, valid, length: int) -> tuple:
        dev = root_feat.device
        # Zeros: rows past the request's are masked, and must be finite.
        inputs = dict(root=torch.empty_like(root_feat),
                      k=past_k.new_zeros((length,) + tuple(past_k.shape[1:])),
                      v=past_v.new_zeros((length,) + tuple(past_v.shape[1:])),
                      valid=torch.zeros(length, dtype=torch.bool, device=dev),
                      base=torch.zeros((), dtype=torch.int64, device=dev))
        self._fill(inputs, root_feat, past_k, past_v, base, valid)
        args = (inputs["root"], inputs["k"], inputs["v"], inputs["valid"], inputs["base"])
        eager = self.levels(*args).clone()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            table = self.levels(*args)
        graph.replay()
        exact = (table[[0, 2, 3]] == eager[[0, 2, 3]]).all()
        close = torch.allclose(table[1], eager[1], rtol=1e-3, atol=1e-3)
        if not (bool(exact) and close):
            raise RuntimeError("the replayed expansion differs from the eager one")
        return graph, inputs, table

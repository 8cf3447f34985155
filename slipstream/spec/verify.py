"""One verifier for every proposer: greedy matching and lossless rejection
sampling, over chains and trees, for a batch of requests at once.

Stochastic rule (Leviathan et al. / Chen et al., generalised to trees as in
SpecInfer's multi-step speculative sampling): standing at verification row r
with target distribution p, try r's children in order; child x, drawn from q,
is accepted with probability min(1, p(x) / q(x)); after a rejection
p <- norm(max(0, p - q)) and the next sibling is tried against that residual.
When a child is accepted the walk descends into it with the target's p there;
when every child is rejected the request's last token is drawn from the
residual; at a leaf (all accepted) a bonus token is drawn from p. Each step of
the walk emits exactly p's distribution, so the output is distributed as the
target's own samples, whatever the draft. Greedy rows take p = one-hot(argmax):
a child is accepted iff it is the argmax, which is plain greedy decoding.

No host sync: the walk loops over the tree's depth and the widest sibling
group, both host ints, with every per-request decision a masked tensor op.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from slipstream.layers import sampler
from slipstream.layers.argmax import row_argmax
from slipstream.layers.sampler import (Penalties, SamplingBatch, apply_min_p, apply_penalties,
                                       apply_top_k_top_p, random_sample)
from slipstream.sampling_params import SAMPLING_EPS
from slipstream.spec.tree import TreeBatch


@dataclass
class VerifyOutput:
    tokens: torch.Tensor          # [B, D + 1] int64: accepted drafts, then the last token; -1 pad
    num_accepted: torch.Tensor    # [B] int64, draft tokens accepted (tokens emitted = this + 1)
    accepted_nodes: torch.Tensor  # [B, D] int64 node indices of the accepted path; -1 pad
    last_row: torch.Tensor        # [B] int64 verification row the walk ended on (0 = root)


def target_probs(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """The distribution the plain sampler draws from, row by row.

    logits: [R, V] float32 (penalties, if any, already applied); sb has R rows.
    Returns [R, V] float32: one-hot(argmax) for greedy rows; otherwise softmax
    after temperature, min-p, top-k and top-p, in the Sampler's order."""
    logits = logits.float()
    greedy = None if sb.all_random else logits.argmax(dim=-1)
    if sb.all_greedy:
        return torch.nn.functional.one_hot(greedy, logits.shape[1]).float()
    temperature = torch.where(sb.temperature < SAMPLING_EPS, 1.0, sb.temperature)
    logits = logits / temperature.unsqueeze(1)
    if sb.min_p is not None:
        logits = apply_min_p(logits, sb.min_p)
    if sb.top_p is not None and logits.device.type == "cpu" and sampler.CPU_NUCLEUS:
        probs = _nucleus_probs(logits, sb)
    else:
        probs = apply_top_k_top_p(logits, sb.top_k, sb.max_top_k, sb.top_p).softmax(dim=-1)
    if greedy is None:
        return probs
    hot = torch.nn.functional.one_hot(greedy, logits.shape[1]).float()
    return torch.where((sb.temperature < SAMPLING_EPS).unsqueeze(1), hot, probs)


def _nucleus_probs(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """top-k / top-p then softmax as `apply_top_k_top_p` gives them, on a CPU: rows
    whose kept set lies among their likeliest tokens (`sampler.nucleus_candidates`,
    as the plain CPU sampler draws) without a sort of the whole vocabulary (~2 ms a
    49k row there), the others through it."""
    weights, ids, ok = sampler.nucleus_candidates(logits, sb.top_k, sb.top_p)
    probs = torch.zeros_like(logits).scatter_(1, ids, weights / weights.sum(-1, keepdim=True))
    if not bool(ok.all()):
        slow = (~ok).nonzero()[:, 0]
        top_k = None if sb.top_k is None else sb.top_k[slow]
        probs[slow] = apply_top_k_top_p(logits[slow], top_k, sb.max_top_k,
                                        sb.top_p[slow]).softmax(dim=-1)
    return probs


def _finish(trees: TreeBatch, path: torch.Tensor, last: torch.Tensor,
            cur: torch.Tensor) -> VerifyOutput:
    b = path.shape[0]
    num_accepted = (path >= 0).sum(dim=1)
    drafted = trees.tokens.gather(1, (path + 1).clamp_min(0))       # [B, D]
    drafted = torch.where(path >= 0, drafted, -1)
    tokens = torch.cat([drafted, drafted.new_full((b, 1), -1)], dim=1)
    tokens.scatter_(1, num_accepted[:, None], last[:, None])
    return VerifyOutput(tokens, num_accepted, path, cur)


def verify_greedy(target_argmax: torch.Tensor, trees: TreeBatch) -> VerifyOutput:
    """target_argmax: [B, N + 1] int64, the target's argmax at each
    verification row. Accept the child equal to the argmax, descend, repeat:
    without a loop over depth (a fixed, small number of device ops, whatever
    the tree) when the batch carries its structure, else by the walk.

    A node is on the accepted path iff every node from the root's child down
    to it is `chosen`: its token is the argmax at its parent and no earlier
    sibling's is (the walk takes the first match; sibling tokens may repeat).
    Those nodes form one chain, at most one per depth."""
    if trees.relations is None:
        return verify_greedy_walk(target_argmax, trees)
    b, n1 = target_argmax.shape
    rel = trees.relations.float()                                    # [B, 2, N + 1, N + 1]
    real = trees.depths > 0                                          # nodes, not root / padding
    correct = real & (trees.tokens == target_argmax.gather(1, trees.parent_rows))
    blocked = torch.bmm(rel[:, 1], correct.float().unsqueeze(2)).squeeze(2) > 0
    off_path = torch.bmm(rel[:, 0], (~(correct & ~blocked)).float().unsqueeze(2)).squeeze(2)
    good = real & (off_path == 0)                                    # [B, N + 1]
    rows = torch.arange(n1, device=target_argmax.device)
    last_row = torch.where(good, rows, 0).amax(dim=1)                # the deepest accepted node
    d = trees.depth
    path = torch.full((b, d + 1), -1, dtype=torch.int64, device=target_argmax.device)
    path.scatter_(1, torch.where(good, trees.depths - 1, d), (rows - 1).expand(b, -1).contiguous())
    return _finish(trees, path[:, :d].contiguous(), target_argmax.gather(1, last_row[:, None])[:, 0],
                   last_row)


def verify_greedy_walk(target_argmax: torch.Tensor, trees: TreeBatch) -> VerifyOutput:
    """`verify_greedy` level by level (the reference it is tested against)."""
    b, device = target_argmax.shape[0], target_argmax.device
    rows = torch.arange(b, device=device)
    cur = torch.zeros(b, dtype=torch.int64, device=device)
    live = torch.ones(b, dtype=torch.bool, device=device)
    path = torch.full((b, trees.depth), -1, dtype=torch.int64, device=device)
    for level in range(trees.depth):
        want = target_argmax[rows, cur]                              # [B]
        kids = trees.children[rows, cur]                             # [B, K]
        match = (kids > 0) & (trees.tokens[rows[:, None], kids] == want[:, None])
        found = live & match.any(dim=1)
        # The first matching sibling (tokens of siblings may repeat in a tree).
        child = kids.gather(1, match.int().argmax(dim=1, keepdim=True)).squeeze(1)
        cur = torch.where(found, child, cur)
        path[:, level] = torch.where(found, child - 1, -1)
        live = found
    return _finish(trees, path, target_argmax[rows, cur], cur)


def _uniforms(trees: TreeBatch, generators: dict[int, torch.Generator],
              device: torch.device) -> torch.Tensor:
    """[B, N + 1] uniforms, one per node (each node is tried at most once). A
    seeded row draws exactly its own node count from its generator, so its
    tokens do not depend on what else shares the batch."""
    u = torch.empty(len(trees.num_nodes), trees.tokens.shape[1], device=device)
    if len(generators) < u.shape[0]:
        u.uniform_()
    for row, g in generators.items():
        n = trees.num_nodes[row]
        draw = torch.empty(n, device=g.device).uniform_(generator=g)
        u[row, 1:n + 1].copy_(draw, non_blocking=True)
    return u


def verify_sampled(probs: torch.Tensor, trees: TreeBatch,
                   generators: dict[int, torch.Generator] | None = None) -> VerifyOutput:
    """probs: [B, N + 1, V] float32, the target distribution at each
    verification row (`target_probs`). Multi-candidate rejection sampling as
    in the module docstring; trees.draft_probs None means one-hot drafts.
    generators: row -> the request's generator (seeded requests)."""
    generators = generators or {}
    b, _, v = probs.shape
    device = probs.device
    rows = torch.arange(b, device=device)
    k = max(trees.max_children, 1)
    u = _uniforms(trees, generators, device)
    cur = torch.zeros(b, dtype=torch.int64, device=device)
    live = torch.ones(b, dtype=torch.bool, device=device)
    path = torch.full((b, trees.depth), -1, dtype=torch.int64, device=device)
    final = probs[:, 0].clone()
    for level in range(trees.depth + 1):
        p = probs[rows, cur]                                         # [B, V]
        moved = torch.zeros_like(live)
        for s in range(k if level < trees.depth else 0):
            child = trees.children[rows, cur, s]                     # [B], 0 = none
            trying = live & ~moved & (child > 0)
            x = trees.tokens[rows, child]                            # [B]
            px = p.gather(1, x[:, None]).squeeze(1)
            if trees.draft_probs is None:
                qx = torch.ones_like(px)
                residual = p.scatter(1, x[:, None], 0.0)
            else:
                q = trees.draft_probs[rows, child]                   # [B, V]
                qx = q.gather(1, x[:, None]).squeeze(1)
                residual = (p - q).clamp_min(0.0)
            ok = trying & (u[rows, child] * qx < px)
            # A rejection is impossible where the residual has no mass (p <= q
            # everywhere means p == q); the guard only keeps rounding from
            # dividing by zero.
            mass = residual.sum(dim=1, keepdim=True)
            residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p)
            p = torch.where((trying & ~ok)[:, None], residual, p)
            cur = torch.where(ok, child, cur)
            path[:, level] = torch.where(ok, child - 1, path[:, level])
            moved |= ok
        ends = live & ~moved
        final = torch.where(ends[:, None], p, final)
        live = moved
    last = random_sample(final, generators)
    return _finish(trees, path, last, cur)


def verify_chain(row, drafts: list[int], generator: torch.Generator | None = None,
                 draft_row=None, vocab_size: int | None = None) -> list[int]:
    """`verify_sampled` for one request's chain, with the target's rows computed only
    as the walk reaches them: draft d_i, drawn from q_i, is accepted with probability
    min(1, p_i(d_i) / q_i(d_i)); at the first rejection the last token is drawn from
    norm(max(0, p_i - q_i)), after a whole chain from p_D.

    row(i) -> (ids [n] int64 or None for the whole vocabulary, probs [n] float32
    summing to 1): p at verification row i (the root's row is 0), as
    `sampler.row_distribution` gives it. draft_row(i): q_i in the same form (the
    distribution d_i was drawn from); None: deterministic drafts (q = one-hot: accepted
    with probability p_i(d_i), a rejection redrawn from p_i without d_i). vocab_size:
    the target's, with draft_row. generator: the request's (seeded) or None.
    Returns the emitted tokens: the accepted drafts, then the last one."""
    for i, d in enumerate(drafts):
        ids, probs = row(i)
        pd = _prob(ids, probs, d)
        q = None if draft_row is None else draft_row(i)
        qd = 1.0 if q is None else _prob(*q, d)
        if float(torch.rand(1, generator=generator)) * qd < pd:
            continue
        if q is None:
            if pd > 0.0 and pd < 1.0:
                at = torch.tensor([d]) if ids is None else (ids == d).nonzero()[:, 0]
                probs = _without(probs, at)
            return drafts[:i] + [sampler.draw(ids, probs, generator)]
        p = _dense(ids, probs, vocab_size)
        residual = (p - _dense(*q, vocab_size)).clamp_min_(0.0)
        # (no mass left only where p == q up to rounding: then p itself)
        return drafts[:i] + [sampler.draw(None, residual if bool(residual.sum() > 0) else p,
                                          generator)]
    return drafts + [sampler.draw(*row(len(drafts)), generator)]


def _prob(ids: torch.Tensor | None, probs: torch.Tensor, token: int) -> float:
    if ids is None:
        return float(probs[token])
    at = (ids == token).nonzero()[:, 0]
    return float(probs[at].sum()) if len(at) else 0.0


def _dense(ids: torch.Tensor | None, probs: torch.Tensor, n: int | None) -> torch.Tensor:
    if ids is None:
        return probs
    return torch.zeros(n, dtype=probs.dtype).index_add_(0, ids, probs)


def _without(probs: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """The residual after a one-hot draft is rejected: p with the draft's entry set to
    0 (the draw renormalises)."""
    probs = probs.clone()
    probs[at] = 0.0
    return probs


def constrain(logits: torch.Tensor, trees: TreeBatch, sb: SamplingBatch) -> torch.Tensor:
    """The logits plain decoding would sample from at each verification row.

    logits: [B, N + 1, V] raw. Each request's logit_bias is added to all its rows;
    penalties count, at row r, the request's outputs so far plus the draft tokens on
    the path from the root down to node r (`relations[:, 0]`: ancestors and r itself,
    the root left out; the root token is already among the outputs), which is what
    the request will have emitted when it samples from row r. Returns `logits`
    itself when neither is asked for, else a new tensor. No host sync."""
    if sb.logit_bias is None and sb.penalties is None:
        return logits
    b, r, v = logits.shape
    dev = logits.device
    out = logits.float()
    if sb.logit_bias is not None:
        rows, ids, vals = sb.logit_bias
        n = rows.shape[0]
        level = torch.arange(r, device=dev).expand(n, r)
        out = out.index_put((rows[:, None].expand(n, r), level, ids[:, None].expand(n, r)),
                            vals[:, None].expand(n, r), accumulate=True)
    if sb.penalties is not None:
        pen = sb.penalties
        if trees.relations is None:
            raise ValueError("penalties under speculation need the trees' relations")
        counts = pen.output_counts.float()[:, None, :].repeat(1, r, 1)      # [B, R, V]
        bi = torch.arange(b, device=dev)[:, None, None].expand(b, r, r)
        ri = torch.arange(r, device=dev)[None, :, None].expand(b, r, r)
        tok = trees.tokens[:, None, :].expand(b, r, r)                     # token of node c
        counts.index_put_((bi.reshape(-1), ri.reshape(-1), tok.reshape(-1)),
                          trees.relations[:, 0].float().reshape(-1), accumulate=True)
        out = apply_penalties(out.reshape(b * r, v), Penalties(
            repetition=_each_row(pen.repetition, r), frequency=_each_row(pen.frequency, r),
            presence=_each_row(pen.presence, r), output_counts=counts.view(b * r, v),
            prompt_mask=_each_row(pen.prompt_mask, r))).view(b, r, v)
    return out


def verify(logits: torch.Tensor, trees: TreeBatch, sb: SamplingBatch) -> VerifyOutput:
    """logits: [B, N + 1, V] at each request's verification rows (pad rows
    beyond a request's nodes are never read); sb: one row per request. Logit
    bias and penalties are applied here (`constrain`)."""
    logits = constrain(logits, trees, sb)
    b, r, v = logits.shape
    if sb.all_greedy:
        # On a GPU torch's argmax (a block a row) fills the device with a tree's rows;
        # on the CPU the two-pass argmax is 2-3x faster (layers/argmax.py).
        best = logits.argmax(dim=-1) if logits.is_cuda else \
            row_argmax(logits.reshape(b * r, v)).view(b, r)
        return verify_greedy(best, trees)
    expanded = _repeat_rows(sb, r)
    probs = target_probs(logits.reshape(b * r, v), expanded).view(b, r, v)
    return verify_sampled(probs, trees, sb.generators)


def _each_row(t: torch.Tensor | None, r: int) -> torch.Tensor | None:
    """A per-request tensor with each request's row repeated for its r verification rows."""
    return None if t is None else t.repeat_interleave(r, dim=0)


def _repeat_rows(sb: SamplingBatch, r: int) -> SamplingBatch:
    """The batch's per-row settings, each row repeated r times (for target_probs)."""
    return SamplingBatch(
        num_rows=sb.num_rows * r, all_greedy=sb.all_greedy, all_random=sb.all_random,
        temperature=_each_row(sb.temperature, r), top_k=_each_row(sb.top_k, r),
        max_top_k=sb.max_top_k, top_p=_each_row(sb.top_p, r), min_p=_each_row(sb.min_p, r),
        generators={}, penalties=None, min_tokens_mask=None, max_num_logprobs=None)

"""The verifier reproduces the target distribution exactly.

A toy target p(. | prefix) and draft q(. | prefix) over a 4-token vocabulary
are random tables. Each trial drafts a tree from q, verifies it, and - where
the round emitted fewer than L = depth + 1 tokens - finishes the sequence by
plain sampling from p, so the first L tokens of a lossless verifier follow
p(t1) p(t2 | t1) p(t3 | t1 t2) exactly. Test: Pearson chi-square over the
4^3 = 64 outcomes of 200k trials (fixed seed), p-value > 1e-3. The negative
controls (a verifier told the wrong q; a residual never updated) must fail
the same test with p-value < 1e-12, which shows the test has the power to
see a lossy rule.
"""
import itertools

import numpy as np
import pytest
import torch

from slipstream.spec.tree import DraftTree, TreeBatch
from slipstream.spec.verify import verify_greedy, verify_sampled

V, L, TRIALS = 4, 3, 200_000


def _table(seed, sharp=1.5, zero_some=False):
    g = np.random.default_rng(seed)
    out = {}
    for n in range(L):
        for prefix in itertools.product(range(V), repeat=n):
            logits = g.normal(0, sharp, V)
            if zero_some:  # a target that gives some tokens probability 0 (top-k like)
                logits[g.choice(V, 1)] = -np.inf
            p = np.exp(logits - logits.max())
            out[prefix] = p / p.sum()
    return out


def _draw(rng, dist_rows):
    """One draw per row of [n, V] probabilities."""
    c = dist_rows.cumsum(axis=1)
    return (rng.random((dist_rows.shape[0], 1)) * c[:, -1:] > c).sum(axis=1)


def _run(tree_parents, p_tab, q_tab, deterministic=False, claimed_q_tab=None, seed=0):
    """Draft TRIALS trees, verify them in one batch, finish to L tokens."""
    rng = np.random.default_rng(seed)
    n = len(tree_parents)
    shape_tree = DraftTree(torch.zeros(n, dtype=torch.int64), tuple(tree_parents))
    depth = shape_tree.depth
    tokens = np.zeros((TRIALS, n + 1), dtype=np.int64)
    prefixes = [[()] * TRIALS]          # prefix of each verification row, per trial
    for j, par in enumerate(tree_parents):
        pre = prefixes[par + 1]
        qrows = np.stack([q_tab[pr] for pr in pre])
        if deterministic:
            # The i-th sibling takes the i-th most likely draft token.
            rank = sum(1 for jj in range(j) if tree_parents[jj] == par)
            tokens[:, j + 1] = np.argsort(-qrows, axis=1, kind="stable")[:, rank]
        else:
            tokens[:, j + 1] = _draw(rng, qrows)
        prefixes.append([pr + (int(t),) for pr, t in zip(pre, tokens[:, j + 1])])
    probs = np.stack([np.stack([p_tab[pr] for pr in col]) for col in prefixes], axis=1)
    batch = TreeBatch.stack([shape_tree], "cpu")
    claimed = claimed_q_tab or q_tab
    q = None
    if not deterministic:
        q = np.zeros((TRIALS, n + 1, V), dtype=np.float32)
        for j, par in enumerate(tree_parents):
            q[:, j + 1] = np.stack([claimed[pr] for pr in prefixes[par + 1]])
        q = torch.from_numpy(q)
    trees = TreeBatch(torch.from_numpy(tokens), batch.children.expand(TRIALS, -1, -1), q,
                      [n] * TRIALS, depth, batch.max_children)
    torch.manual_seed(seed)
    out = verify_sampled(torch.from_numpy(probs).float(), trees)
    emitted = out.tokens.numpy()
    count = out.num_accepted.numpy() + 1
    seqs = np.zeros((TRIALS, L), dtype=np.int64)
    for i in range(L):
        have = count > i
        seqs[have, i] = emitted[have, i]
        need = np.nonzero(~have)[0]
        for pr in set(tuple(seqs[t, :i]) for t in need):
            rows = need[(seqs[need, :i] == np.array(pr, dtype=np.int64)).all(axis=1)]
            seqs[rows, i] = _draw(rng, np.tile(p_tab[pr], (len(rows), 1)))
    return seqs, out


def _pvalue(seqs, p_tab):
    idx = (seqs * V ** np.arange(L - 1, -1, -1)).sum(axis=1)
    observed = np.bincount(idx, minlength=V ** L)
    expected = np.zeros(V ** L)
    for seq in itertools.product(range(V), repeat=L):
        pr = np.prod([p_tab[seq[:i]][seq[i]] for i in range(L)])
        expected[int(np.dot(seq, V ** np.arange(L - 1, -1, -1)))] = pr * len(seqs)
    keep = expected > 0
    assert observed[~keep].sum() == 0, "emitted a sequence of target probability 0"
    stat = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    dof = keep.sum() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


CHAIN = [-1, 0]                 # two draft tokens
TREE = [-1, -1, 0, 0, 1]        # two siblings at the root, two and one below


@pytest.mark.parametrize("parents", [CHAIN, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["sampled-q", "one-hot-q"])
def test_rejection_sampling_is_lossless(parents, deterministic):
    p_tab, q_tab = _table(1), _table(2)
    seqs, out = _run(parents, p_tab, q_tab, deterministic)
    assert _pvalue(seqs, p_tab) > 1e-3
    # Every acceptance length occurs (the test exercises each branch of the walk).
    assert set(out.num_accepted.tolist()) == {0, 1, 2}


def test_lossless_with_a_bad_draft_and_zero_probability_targets():
    # The draft is nearly uniform and the target forbids one token per prefix.
    p_tab, q_tab = _table(3, sharp=3.0, zero_some=True), _table(4, sharp=0.1)
    seqs, out = _run(TREE, p_tab, q_tab)
    assert _pvalue(seqs, p_tab) > 1e-3
    assert out.num_accepted.float().mean() < 1.0


def test_negative_control_wrong_q_is_detected():
    p_tab, q_tab = _table(1), _table(2)
    seqs, _ = _run(TREE, p_tab, q_tab, claimed_q_tab=_table(5))
    assert _pvalue(seqs, p_tab) < 1e-12


def test_negative_control_no_residual_update_is_detected(monkeypatch):
    # Rejections resample from p itself instead of norm(max(0, p - q)).
    real = torch.Tensor.clamp_min

    def no_residual(self, m):
        return real(self, m) * 0 if self.dim() == 2 and self.shape[1] == V else real(self, m)
    monkeypatch.setattr(torch.Tensor, "clamp_min", no_residual)
    p_tab, q_tab = _table(1), _table(2)
    seqs, _ = _run(CHAIN, p_tab, q_tab)
    monkeypatch.undo()
    assert _pvalue(seqs, p_tab) < 1e-12


def test_greedy_accepts_the_argmax_path_and_adds_the_bonus():
    #          root
    #        /      \
    #      n0=5     n1=7
    #      |        |
    #      n2=3     n3=2
    tree = DraftTree(torch.tensor([5, 7, 3, 2]), (-1, -1, 0, 1))
    chain = DraftTree.chain([4, 4, 4])
    none = DraftTree.empty()
    tb = TreeBatch.stack([tree, chain, none, tree], "cpu")
    # argmax per verification row (root first); pad rows are never read.
    argmax = torch.tensor([[7, 9, 2, 9, 8],     # root->7 (n1), n1->2 (n3), n3 leaf -> bonus 8
                           [4, 4, 1, 0, 0],     # 4 accepted, 4 accepted, then 1 != 4 -> emit 1
                           [6, 0, 0, 0, 0],     # no draft: the plain greedy token
                           [1, 0, 0, 0, 0]])    # nothing matches at the root
    out = verify_greedy(argmax, tb)
    assert out.num_accepted.tolist() == [2, 2, 0, 0]
    # The chain makes the batch 3 deep: 4 token columns, 3 path columns.
    assert out.tokens.tolist() == [[7, 2, 8, -1], [4, 4, 1, -1], [6, -1, -1, -1], [1, -1, -1, -1]]
    assert out.accepted_nodes.tolist() == [[1, 3, -1], [0, 1, -1], [-1, -1, -1], [-1, -1, -1]]
    assert out.last_row.tolist() == [4, 2, 0, 0]


def test_ragged_batch_sampled_equals_each_alone():
    # Each row's walk depends on its own inputs only: requests accepting 0,
    # some and all drafts in one batch get what they would alone.
    g = torch.Generator().manual_seed(0)
    trees = [DraftTree.chain([1, 2, 3]), DraftTree.chain([0, 0]), DraftTree.empty(),
             DraftTree(torch.tensor([3, 1, 2]), (-1, -1, 0))]
    probs = []
    for t in trees:
        rows = torch.rand(t.num_nodes + 1, 5, generator=g)
        probs.append(rows / rows.sum(1, keepdim=True))
    # Make tree 0 accept all (p = one-hot on its drafts), tree 1 reject at once.
    probs[0][:3] = torch.nn.functional.one_hot(torch.tensor([1, 2, 3]), 5).float()
    probs[1][0] = torch.tensor([0.0, 0.5, 0.5, 0.0, 0.0])
    width = 4
    padded = torch.stack([torch.cat([p, p[:1].expand(width - p.shape[0], -1)]) for p in probs])
    gens = {i: torch.Generator().manual_seed(10 + i) for i in range(4)}
    together = verify_sampled(padded, TreeBatch.stack(trees, "cpu"), gens)
    for i, t in enumerate(trees):
        alone = verify_sampled(probs[i][None], TreeBatch.stack([t], "cpu"),
                               {0: torch.Generator().manual_seed(10 + i)})
        n = int(alone.num_accepted)
        assert int(together.num_accepted[i]) == n
        assert together.tokens[i, :n + 1].tolist() == alone.tokens[0, :n + 1].tolist()
    assert together.num_accepted[0] == 3 and together.num_accepted[1] == 0


def test_greedy_without_a_depth_loop_equals_the_walk():
    """The structured greedy rule (no loop over depth) accepts exactly what
    the level-by-level walk accepts: random trees of different sizes in one
    batch, a 3-token vocabulary so that siblings repeat tokens and the first
    match must win, chains and empty drafts included."""
    from slipstream.spec.verify import verify_greedy_walk
    g = np.random.default_rng(0)
    longest = 0
    for trial in range(40):
        trees = []
        for _ in range(int(g.integers(1, 6))):
            n = int(g.integers(0, 12))
            parents = [int(g.integers(-1, j)) for j in range(n)]
            if trial % 4 == 0:
                parents = list(range(-1, n - 1))
            trees.append(DraftTree(torch.from_numpy(g.integers(0, 3, n)), tuple(parents)))
        tb = TreeBatch.stack(trees, "cpu")
        argmax = torch.from_numpy(g.integers(0, 3, (len(trees), tb.tokens.shape[1])))
        fast, walk = verify_greedy(argmax, tb), verify_greedy_walk(argmax, tb)
        for f in ("tokens", "num_accepted", "accepted_nodes", "last_row"):
            assert torch.equal(getattr(fast, f), getattr(walk, f)), (trial, f)
        longest = max(longest, int(walk.num_accepted.max()))
    assert tb.relations is not None
    assert longest >= 3        # deep paths were compared, not only rejections


def test_constrain_matches_the_sampler_at_every_row():
    """Logit bias and penalties at each verification row equal what the plain
    sampler applies after the request has emitted the path down to that row:
    two requests with different trees, one of them without penalties."""
    from slipstream.layers.sampler import Penalties, SamplingBatch, apply_penalties
    from slipstream.spec.verify import constrain
    g = torch.Generator().manual_seed(3)
    v = 12
    trees = [DraftTree(torch.tensor([4, 7, 4, 9, 4]), (-1, -1, 0, 1, 2)),
             DraftTree(torch.tensor([2, 2]), (-1, 0))]
    tb = TreeBatch.stack(trees, "cpu")
    b, r = 2, tb.tokens.shape[1]
    logits = torch.randn(b, r, v, generator=g) * 3
    counts = torch.zeros(b, v, dtype=torch.int32)
    counts[0, 4], counts[0, 1], counts[1, 2] = 2, 1, 1
    prompt = torch.zeros(b, v, dtype=torch.bool)
    prompt[0, 9] = prompt[1, 5] = True
    pen = Penalties(repetition=torch.tensor([1.3, 1.0]), frequency=torch.tensor([0.4, 0.0]),
                    presence=torch.tensor([0.25, 0.0]), output_counts=counts, prompt_mask=prompt)
    bias = (torch.tensor([0, 1, 1]), torch.tensor([7, 2, 3]), torch.tensor([1.5, -2.0, 0.5]))
    sb = SamplingBatch(num_rows=b, all_greedy=True, all_random=False, temperature=None, top_k=None,
                       max_top_k=v, top_p=None, min_p=None, generators={}, penalties=pen,
                       min_tokens_mask=None, max_num_logprobs=None, logit_bias=bias)
    got = constrain(logits, tb, sb)
    for i, t in enumerate(trees):
        for row in range(t.num_nodes + 1):
            path, node = [], row - 1          # the draft tokens from the root's child down to row
            while node >= 0:
                path.append(int(t.tokens[node]))
                node = t.parents[node]
            c = counts[i].clone()
            for tok in path:
                c[tok] += 1
            x = logits[i, row].clone()
            for bi, bt, bv in zip(*bias):
                if bi == i:
                    x[bt] += bv
            want = apply_penalties(x[None], Penalties(pen.repetition[i:i + 1], pen.frequency[i:i + 1],
                                                      pen.presence[i:i + 1], c[None], prompt[i:i + 1]))
            assert torch.allclose(got[i, row], want[0], atol=1e-6), (i, row)
    plain = SamplingBatch(num_rows=b, all_greedy=True, all_random=False, temperature=None, top_k=None,
                          max_top_k=v, top_p=None, min_p=None, generators={}, penalties=None,
                          min_tokens_mask=None, max_num_logprobs=None)
    assert constrain(logits, tb, plain) is logits


def _chain_run(p_tab, q_tab, sparse, trials=40_000, seed=0, sampled=False, claimed_q_tab=None):
    """The chain of two drafts of q (argmax, or drawn from q with `sampled`) verified by
    `verify_chain`, one trial at a time, finished to L tokens by plain sampling from p.
    sparse: rows given as (ids, probs) over the tokens of nonzero probability, else
    dense (None, p). claimed_q_tab: the q the verifier is told (sampled drafts)."""
    from slipstream.spec.verify import verify_chain
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    seqs = np.zeros((trials, L), dtype=np.int64)
    accepted = set()

    def as_rows(tab):
        rows = {}
        for prefix, p in tab.items():
            t = torch.from_numpy(p).float()
            ids = t.nonzero()[:, 0]
            rows[prefix] = (ids, t[ids]) if sparse else (None, t)
        return rows
    rows, q_rows = as_rows(p_tab), as_rows(claimed_q_tab or q_tab)
    for n in range(trials):
        drafts, pre = [], ()
        for _ in range(L - 1):
            d = int(_draw(rng, q_tab[pre][None])[0]) if sampled else int(np.argmax(q_tab[pre]))
            drafts.append(d)
            pre += (d,)
        q = (lambda i: q_rows[tuple(drafts[:i])]) if sampled else None
        out = verify_chain(lambda i: rows[tuple(drafts[:i])], drafts, gen, q, V)
        accepted.add(len(out) - 1)
        while len(out) < L:
            out.append(int(_draw(rng, p_tab[tuple(out)][None])[0]))
        seqs[n] = out[:L]
    return seqs, accepted


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_chain_walk_is_lossless(sparse):
    """verify_chain (one request, rows computed as the walk reaches them) emits the
    target's distribution, with a bad draft and tokens of probability 0 too."""
    p_tab, q_tab = _table(3, sharp=2.0, zero_some=True), _table(4, sharp=0.5)
    seqs, accepted = _chain_run(p_tab, q_tab, sparse)
    assert _pvalue(seqs, p_tab) > 1e-3 and accepted == {0, 1, 2}


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_chain_walk_with_drafts_drawn_from_q_is_lossless(sparse):
    """Drafts drawn from q (the CPU loop's sampled chains): accepted with min(1, p / q),
    a rejection redrawn from norm(max(0, p - q)); q and p with tokens of probability 0."""
    p_tab, q_tab = _table(3, sharp=2.0, zero_some=True), _table(6, sharp=1.0, zero_some=True)
    seqs, accepted = _chain_run(p_tab, q_tab, sparse, sampled=True)
    assert _pvalue(seqs, p_tab) > 1e-3 and accepted == {0, 1, 2}


def test_chain_walk_negative_control_wrong_q():
    """Told another q than the drafts were drawn from, the walk is lossy and the test
    sees it."""
    p_tab, q_tab = _table(1), _table(2)
    seqs, _ = _chain_run(p_tab, q_tab, False, trials=20_000, sampled=True, claimed_q_tab=_table(5))
    assert _pvalue(seqs, p_tab) < 1e-12


def test_chain_walk_negative_control_no_residual(monkeypatch):
    """Redrawing a rejected position from p itself (the draft left in) is lossy, and
    the same test sees it."""
    from slipstream.spec import verify
    monkeypatch.setattr(verify, "_without", lambda probs, at: probs)
    p_tab, q_tab = _table(1), _table(2)
    seqs, _ = _chain_run(p_tab, q_tab, False, trials=20_000)
    assert _pvalue(seqs, p_tab) < 1e-12

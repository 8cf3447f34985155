"""Head training on a tiny target: data packing, the training-time-test passes
against the head's drafting path, losses fall, and the heads load back."""
import torch

from slipstream.spec.eagle import EagleHead, EagleProposer
from slipstream.spec.medusa import MedusaHeads
from slipstream.spec.train import (eagle_shape_for, medusa_rows, split, train_eagle,
                                   train_medusa, ttt_features, ttt_mask)
from slipstream.spec.train_data import (Samples, branch_prefixes, check_alignment,
                                        dense_output_weights, features_of, features_of_many)
from tests.engine.conftest import tiny_folder  # noqa: F401 - fixture
from tests.spec.conftest import repeating_samples


def test_packed_features_equal_one_sequence_at_a_time(tiny_target):
    seqs = [torch.arange(3, 3 + n) % 90 for n in (7, 19, 5, 12)]
    many = features_of_many(tiny_target, seqs, max_tokens_per_forward=24)
    for s, f in zip(seqs, many):
        assert torch.allclose(f.float(), features_of(tiny_target, s), atol=1e-4)


def test_dense_weights_and_alignment_check(tiny_target):
    lm, emb = dense_output_weights(tiny_target)
    h = torch.randn(3, tiny_target.config.hidden_size)
    assert torch.allclose(h @ lm.T, tiny_target.compute_logits(h).float(), atol=1e-4)
    assert torch.equal(emb[5], tiny_target.model.embed_tokens.weight[5].float())
    # Greedy answers line up with their features; a shifted copy does not.
    seq = [7, 8, 9]
    for _ in range(12):
        f = features_of(tiny_target, torch.tensor(seq))
        seq.append(int(tiny_target.compute_logits(f[-1:]).argmax()))
    good = Samples.pack([torch.tensor(seq)], [features_of(tiny_target, torch.tensor(seq))], [3])
    assert check_alignment(tiny_target, good) == 1.0
    bad = Samples.pack([torch.tensor(seq)], [features_of(tiny_target, torch.tensor(seq)).roll(1, 0)], [3])
    assert check_alignment(tiny_target, bad) < 1.0


def test_branches_take_the_second_choice_inside_the_answer(tiny_target):
    # A greedy answer of 16 tokens after a 3-token prompt.
    seq = [7, 8, 9]
    for _ in range(16):
        f = features_of(tiny_target, torch.tensor(seq))
        seq.append(int(tiny_target.compute_logits(f[-1:]).argmax()))
    seqs = [torch.tensor(seq)]
    feats = features_of_many(tiny_target, seqs)
    gen = torch.Generator().manual_seed(0)
    out, parents = branch_prefixes(tiny_target, seqs, feats, [3], branches=3, within=8,
                                   generator=gen)
    assert parents == [0, 0, 0]
    assert len(out) == 3 and len({len(p) for p in out}) == 3      # three distinct points
    for prefix in out:
        p = len(prefix) - 1                                       # the swapped position
        assert 3 <= p < 3 + 8 and prefix[:p] == seq[:p]
        logits = tiny_target.compute_logits(feats[0][p - 1:p].float())[0]
        assert prefix[p] == int(logits.topk(2).indices[1]) != seq[p]
    # Fewer answer tokens than branches asked: one branch a position; none without an answer.
    assert len(branch_prefixes(tiny_target, seqs, feats, [17], 3, 8, gen)[0]) == 1
    assert branch_prefixes(tiny_target, seqs, feats, [18], 3, 8, gen) == ([], [])


def test_held_out_answers_keep_their_branches_out_of_training():
    # 40 answers, then two branches of each: the last answer is held out, its branches unused.
    n = 40
    parents = list(range(n)) + [q for q in range(n) for _ in range(2)]
    seqs = [torch.arange(5)] * len(parents)
    s = Samples.pack(seqs, [torch.zeros(5, 2)] * len(parents), [2] * len(parents), parents)
    train, held = split(s)
    assert held == [n - 1]
    assert n - 1 not in train and len(train) == len(parents) - 3
    assert split(Samples.pack(seqs[:n], [torch.zeros(5, 2)] * n, [2] * n)) == (
        list(range(n - 1)), [n - 1])


def test_medusa_rows_label_the_tokens_after_the_root():
    s = Samples.pack([torch.arange(10, 16)], [torch.zeros(6, 4)], [3])
    rows, labels = medusa_rows(s, [0], 2)
    # roots at answer positions: feature rows 2..3; head i labels token row + 1 + i
    assert rows.tolist() == [2, 3]
    assert labels.tolist() == [[14, 15], [15, -100]]


def test_ttt_mask_matches_drafting_context():
    m = ttt_mask(4, 2, "cpu")
    # row 3 of pass 2: real keys 0..1, pass-1 key 2, pass-2 key 3
    assert m[3].nonzero().flatten().tolist() == [0, 1, 4 + 2, 8 + 3]
    assert m.any(dim=1).all()


def test_ttt_passes_compute_what_drafting_computes(tiny_target):
    torch.manual_seed(0)
    shape = eagle_shape_for(tiny_target.config, 64)
    head = EagleHead(shape).eval()
    n, h = 9, shape.hidden_size
    e, feat = torch.randn(1, n, h), torch.randn(1, n, h)
    with torch.no_grad():
        passes = ttt_features(head, e, feat, 3)
        for j in range(2, n):
            # Drafting: real pairs 0 .. j - 2, then depth 2 and 3 along one chain.
            r = j - 2
            f, k, v = head(e[0, :r + 1], feat[0, :r + 1], torch.arange(r + 1), None, None)
            assert torch.allclose(f[-1], passes[0][0, r], atol=1e-5)
            x = f[-1]
            for depth in (1, 2):
                f2, k2, v2 = head(e[0, r + depth:r + depth + 1], x[None],
                                  torch.tensor([r + depth]), (k, v), None)
                k, v = torch.cat([k, k2]), torch.cat([v, v2])
                assert torch.allclose(f2[0], passes[depth][0, r + depth], atol=1e-5)
                x = f2[0]


def test_medusa_training_learns_and_round_trips(tiny_target, tmp_path):
    logs = []
    lm, _ = dense_output_weights(tiny_target)
    heads = train_medusa(lm, repeating_samples(tiny_target), num_heads=2, epochs=30, lr=3e-3,
                         batch=64, log=logs.append)
    first, last = logs[0], logs[-1]
    assert float(last.split("loss ")[1].split(",")[0]) < float(first.split("loss ")[1].split(",")[0])
    heads.save(tmp_path / "m.safetensors")
    again = MedusaHeads.load(tmp_path / "m.safetensors")
    x = torch.randn(3, tiny_target.config.hidden_size)
    assert torch.allclose(again(x), heads(x), atol=1e-2)


def test_eagle_training_learns_and_round_trips(tiny_target, tmp_path):
    logs = []
    lm, emb = dense_output_weights(tiny_target)
    saved = []
    head = train_eagle(lm, emb, repeating_samples(tiny_target), tiny_target.config, epochs=8, lr=3e-3,
                       ttt_steps=2, batch_tokens=64, intermediate_size=64, log=logs.append,
                       checkpoint=lambda m: saved.append(1))
    acc = [eval(line.split("depth ")[1]) for line in logs]
    assert acc[-1][0] > acc[0][0] + 0.15 and len(saved) == 8
    head.save(tmp_path / "e.safetensors")
    again = EagleHead.load(tmp_path / "e.safetensors")
    assert again.shape == head.shape
    p = EagleProposer(again, tiny_target.model.embed_tokens, tiny_target.compute_logits, 3, 2, 2, 5)
    assert p is not None


def test_draft_vocabulary_round_trips_and_drafts_only_its_tokens(tiny_target, tmp_path):
    from slipstream.spec.heads import DraftLMHead, read_draft_vocab, top_tokens
    from slipstream.spec.train import restrict
    vocab, cover = top_tokens(torch.tensor([5, 5, 5, 9, 9, 2, 7]), 3, 100)
    assert vocab.tolist() == [2, 5, 9] or vocab.tolist() == [5, 7, 9]
    assert abs(cover - 6 / 7) < 1e-6
    lm, _ = dense_output_weights(tiny_target)
    w, remap = restrict(lm, torch.tensor([3, 10, 40]))
    assert torch.equal(w, lm[[3, 10, 40]]) and remap[10] == 1 and remap[11] == -100
    head = EagleHead(eagle_shape_for(tiny_target.config, 64))
    head.save(tmp_path / "e.safetensors", torch.tensor([3, 10, 40, 41]))
    v = read_draft_vocab(tmp_path / "e.safetensors")
    assert v.tolist() == [3, 10, 40, 41]
    dl = DraftLMHead(tiny_target, v, torch.float32, "cpu")
    h = torch.randn(2, tiny_target.config.hidden_size)
    assert torch.allclose(dl(h), tiny_target.compute_logits(h)[:, v], atol=1e-4)
    p = EagleProposer(EagleHead.load(tmp_path / "e.safetensors"), tiny_target.model.embed_tokens,
                      dl, 3, 2, 2, 5)
    from slipstream.spec.base import ProposeRequest
    tree = p.propose([ProposeRequest("r", [1, 2, 3, 4], torch.randn(3, h.shape[1]))])[0]
    assert tree.num_nodes == 5 and set(tree.tokens.tolist()) <= {3, 10, 40, 41}


def test_a_parallel_head_learns_its_blind_drafts_from_an_eagle_head(tiny_target, tmp_path):
    """--method peagle --init-head: the EAGLE head's layer carried over unchanged, the
    placeholders trained: the blind depth (the third pass) improves; the file loads
    as a parallel head."""
    lm, emb = dense_output_weights(tiny_target)
    s = repeating_samples(tiny_target)
    eagle = train_eagle(lm, emb, s, tiny_target.config, epochs=4, lr=3e-3, ttt_steps=2,
                        batch_tokens=64, intermediate_size=64, log=lambda m: None)
    kw = dict(ttt_steps=3, batch_tokens=64, log=lambda m: None, parallel=True, init=eagle)
    start = train_eagle(lm, emb, s, tiny_target.config, epochs=1, lr=0.0, **kw)
    head = train_eagle(lm, emb, s, tiny_target.config, epochs=8, lr=3e-2, **kw)
    assert head.shape.parallel == 1 and head.shape.intermediate_size == 64
    before = dict(eagle.named_parameters())
    assert all(torch.equal(a, before[n]) for n, a in head.named_parameters()
               if not n.startswith("mask_"))
    from slipstream.spec.train import eagle_passes
    from slipstream.spec.train_data import pad_batch
    tok, feats, a = pad_batch(s, list(range(len(s))), "cpu")
    with torch.no_grad():
        loss = [eagle_passes(h, emb, lm, tok, feats, a, 3)[2][0] for h in (start, head)]
    assert loss[1] < 0.95 * loss[0], loss        # the blind pass learned
    head.save(tmp_path / "p.safetensors")
    again = EagleHead.load(tmp_path / "p.safetensors")
    assert again.shape.parallel == 1 and torch.equal(again.mask_emb, head.mask_emb.half().float())


def test_samples_with_branches_follow_the_targets_greedy_choices(tiny_folder):
    # The whole data path on a tiny checkpoint: answers, then two branches an answer,
    # each starting after the swapped token; every trained position is a greedy choice.
    from slipstream.spec.train_run import make_samples
    folder, _ = tiny_folder("llama")
    s, _, lm_w, _ = make_samples(folder, ["hello there", "tell me a story"], 12, "cpu",
                                 feature_layers="final", branches=2, branch_tokens=6,
                                 max_num_seqs=8, log=lambda *a: None)
    assert len(s) == 6 and s.parents.tolist()[:2] == [0, 1] and sorted(s.parents.tolist()[2:]) == [0, 0, 1, 1]
    answers = s.lengths - s.answer_starts
    assert answers.tolist()[:2] == [12, 12] and (answers[2:] == 5).all()   # 6 tokens, the first untrained
    for q in range(len(s)):
        off, n, a = int(s.offsets[q]), int(s.lengths[q]), int(s.answer_starts[q])
        rows = torch.arange(off + a - 1, off + n - 1)     # the features of the labels trained
        logits = s.features[rows].float() @ lm_w.T
        # the engine's greedy token (the packed forward and its decode steps round
        # differently in the engine's dtype: near-ties may flip)
        chosen = logits.gather(1, s.tokens[rows + 1][:, None])[:, 0]
        assert (chosen >= logits.max(-1).values - 0.05).all(), q
        if q >= 2:   # a branch shares its answer's prefix up to the swapped token
            p, root = a - 2, int(s.parents[q])
            r_off = int(s.offsets[root])
            assert torch.equal(s.tokens[off:off + p], s.tokens[r_off:r_off + p])
            assert s.tokens[off + p] != s.tokens[r_off + p]

"""Training Medusa heads and the EAGLE head on the target's own outputs.

Data (spec/train_data.py): the target answers the shipped prompts greedily
through the engine; one packed forward gives its final hidden state f_j at
every position (and, for an EAGLE-3 head, the outputs of its feature layers,
which the head fuses into its own feature of the position). Losses are taken where drafting happens (the answers), with
the target's frozen LM head W (dense, [V, hidden]) over the draft vocabulary
(heads.py; all tokens without one);
the labels are the answer tokens, i.e. the target's own argmax.

  Medusa head i: cross-entropy of W head_i(f_j) against token j + 1 + i.
  EAGLE: pair j = (f_j, t_{j+1}) predicts f_{j+1}, whose logits should pick
    t_{j+2}. Training-time test (EAGLE-3): `ttt_steps` passes, pass s being
    drafting depth s + 1: pair j's feature is the head's own prediction from
    pass s - 1 (row j - 1), and row j attends to the real pairs <= j - s plus
    its own draft ancestors (pass i row j - s + i), exactly the context the
    head sees when it drafts. Loss per pass: cross-entropy, plus a small
    smooth-L1 toward f_{j+1} for a head that reads the final hidden state
    (an EAGLE-3 head's output is free: cross-entropy only). A head for parallel drafting (P-EAGLE,
    spec/peagle.py) trains the same passes with its placeholders as the input
    of every pass from the third on.

Both train in large batches on the training device (bf16 autocast on CUDA,
fp32 master weights), AdamW with a one-cycle schedule, a held-out slice of
sequences for top-1 accuracy per head / per depth, a progress bar, and a
safetensors checkpoint after every epoch.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math

import torch
import torch.nn.functional as F

from slipstream.spec.eagle import EagleHead, EagleShape
from slipstream.spec.medusa import MedusaHeads
from slipstream.spec.train_data import Samples, eagle_batches  # noqa: F401 (re-exported)
from slipstream.spec.train_data import pad_batch as _pad


def autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def split(s: Samples, val_fraction: float = 0.03, max_val: int = 128) -> tuple[list[int], list[int]]:
    """Sequence indices (train, held out); the last few answers are held out,
    and the branches of a held-out answer are left out of both."""
    parents = s.parents if s.parents is not None else torch.arange(len(s))
    roots = parents == torch.arange(len(s))
    n = int(roots.sum())               # answers come first, their branches after them
    v = min(max_val, int(n * val_fraction)) if n >= 8 else 0
    held = parents >= n - v
    return (~held).nonzero()[:, 0].tolist(), (held & roots).nonzero()[:, 0].tolist()


def restrict(lm_w: torch.Tensor, vocab: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The LM head rows of the draft vocabulary, and a map token id -> column
    (-100 for tokens outside it, which the losses then skip)."""
    if vocab is None:
        return lm_w, None
    remap = torch.full((lm_w.shape[0],), -100, dtype=torch.int64)
    remap[vocab.cpu()] = torch.arange(vocab.shape[0])
    return lm_w[vocab.to(lm_w.device)], remap


def _relabel(labels: torch.Tensor, remap: torch.Tensor | None) -> torch.Tensor:
    if remap is None:
        return labels
    return torch.where(labels >= 0, remap.to(labels.device)[labels.clamp_min(0)], -100)


def _bar(total: int, desc: str):
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=desc, mininterval=1.0)


# ---- Medusa ---------------------------------------------------------------------

def medusa_rows(s: Samples, seqs: list[int], num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(feature rows [M], labels [M, num_heads]) for roots at answer positions:
    row j (f_j chose t_{j+1}); head i's label is t_{j+1+i}, -100 past the end."""
    rows, labels = [], []
    for q in seqs:
        off, ln, a = int(s.offsets[q]), int(s.lengths[q]), int(s.answer_starts[q])
        j = torch.arange(off + max(a - 1, 0), off + ln - 2)
        want = j[:, None] + 1 + torch.arange(1, num_heads + 1)[None]
        ok = want < off + ln
        labels.append(torch.where(ok, s.tokens[want.clamp_max(off + ln - 1)], -100))
        rows.append(j)
    return torch.cat(rows), torch.cat(labels)


def train_medusa(lm_w: torch.Tensor, s: Samples, num_heads: int = 3, epochs: int = 2,
                 lr: float = 1e-3, batch: int = 4096, log=print, checkpoint=None,
                 vocab: torch.Tensor | None = None) -> MedusaHeads:
    """vocab: the draft vocabulary (None: all tokens)."""
    dev = s.features.device
    lm_w, remap = restrict(lm_w, vocab)
    tr, va = split(s)
    x_idx, y = medusa_rows(s, tr, num_heads)
    vx, vy = medusa_rows(s, va, num_heads) if va else (x_idx[:2048], y[:2048])
    y, vy = _relabel(y, remap), _relabel(vy, remap)
    x_idx, y, vx, vy = x_idx.to(dev), y.to(dev), vx.to(dev), vy.to(dev)
    heads = MedusaHeads(lm_w.shape[1], num_heads).to(dev)
    # clone(): normal tensors even when the inputs were made under inference_mode
    w = lm_w.to(dev, torch.bfloat16 if dev.type == "cuda" else torch.float32).clone()
    opt = torch.optim.AdamW(heads.parameters(), lr=lr, weight_decay=0.0)
    steps_per = math.ceil(x_idx.shape[0] / batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, lr, total_steps=epochs * steps_per)
    with _bar(epochs * steps_per, "medusa") as bar:
        for epoch in range(epochs):
            order = torch.randperm(x_idx.shape[0], device=dev)
            for b in range(0, order.shape[0], batch):
                idx = order[b:b + batch]
                with autocast(dev):
                    logits = F.linear(heads(s.features[x_idx[idx]].float()), w)   # [n, K, V]
                    loss = F.cross_entropy(logits.flatten(0, 1).float(), y[idx].flatten(),
                                           ignore_index=-100)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
                bar.update(1)
                bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False) if b == 0 else None
            acc = medusa_accuracy(heads, w, s.features, vx, vy)
            log(f"medusa epoch {epoch + 1}/{epochs}: loss {loss.item():.3f}, "
                f"held-out top-1 per head {[round(a, 3) for a in acc]}")
            if checkpoint is not None:
                checkpoint(heads)
    return heads.requires_grad_(False)


@torch.no_grad()
def medusa_accuracy(heads, w, feats, rows, labels, chunk: int = 4096) -> list[float]:
    hits = torch.zeros(labels.shape[1], device=labels.device)
    n = (labels >= 0).sum(0).clamp_min(1)
    for b in range(0, rows.shape[0], chunk):
        with autocast(feats.device):
            pred = F.linear(heads(feats[rows[b:b + chunk]].float()), w).argmax(-1)
        hits += (pred == labels[b:b + chunk]).sum(0)
    return (hits / n).tolist()


# ---- EAGLE ------------------------------------------------------------------------

def eagle_shape_for(model_config, intermediate_size: int | None = None,
                    feature_layers: tuple[int, ...] = ()) -> EagleShape:
    c = model_config
    return EagleShape(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                      intermediate_size or c.intermediate_size, c.rope_theta,
                      c.max_position_embeddings, c.rms_norm_eps,
                      feature_layers=",".join(str(i) for i in feature_layers))


def ttt_mask(t: int, step: int, device) -> torch.Tensor:
    """[t, (step + 1) t] bool: row j of pass `step` sees real keys <= j - step
    and, in pass i (1 <= i <= step), key j - step + i."""
    j = torch.arange(t, device=device)[:, None]
    c = torch.arange(t, device=device)[None]
    parts = [c <= j - step] + [c == j - step + i for i in range(1, step + 1)]
    return torch.cat(parts, dim=1)


def ttt_features(head: EagleHead, e: torch.Tensor, feat: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """e, feat: [B, n, hidden], pair j = (feat[:, j], e[:, j]) at position j.
    Returns the predicted features of each training-time-test pass [B, n, hidden]:
    pass s row j is what the head computes when it drafts at depth s + 1 after
    the real pairs <= j - s (see the module docstring). A parallel head's
    passes from s = 2 on read its placeholders instead of a token and a
    feature, as its rows after the first do when it drafts (spec/peagle.py)."""
    sh = head.shape
    n = e.shape[1]
    cos, sin = head.rotary.lookup(torch.arange(n, device=e.device))
    rep = sh.num_heads // sh.num_kv_heads
    keys, vals, outs = [], [], []
    for step in range(steps):
        if step >= 2 and sh.parallel:   # P-EAGLE: drafted blind, from the placeholders
            e = head.mask_emb.to(e.dtype).expand_as(e)
            feat = head.mask_feat.to(feat.dtype).expand_as(feat)
        x = head.fuse(e, feat)
        q, k, v = head.qkv(x, cos, sin)
        keys.append(k.repeat_interleave(rep, dim=2))
        vals.append(v.repeat_interleave(rep, dim=2))
        kk, vv = torch.cat(keys, dim=1), torch.cat(vals, dim=1)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), kk.transpose(1, 2),
                                           vv.transpose(1, 2),
                                           attn_mask=ttt_mask(n, step, e.device)).transpose(1, 2)
        f = head.finish(x, o)
        outs.append(f)
        feat = torch.cat([feat[:, :1], f[:, :-1]], dim=1)   # pair j now gets f^_j
    return outs


def eagle_passes(head: EagleHead, emb_w, lm_w, tok, feats, answer_starts, ttt_steps: int,
                 remap: torch.Tensor | None = None):
    """The training-time-test passes over one padded batch (tok [B, t], -100
    past the end; feats [B, t, (1 + taps) h]). Returns per pass (loss, top-1 hits, rows)."""
    b, t = tok.shape
    n = t - 1                                             # pairs j = 0 .. t - 2
    e = F.embedding(tok[:, 1:].clamp_min(0), emb_w)       # t_{j+1}
    h = head.shape.hidden_size
    target_f = None if head.shape.taps else feats[:, 1:, :h].float()   # f_{j+1}
    label = torch.cat([tok[:, 2:], tok.new_full((b, 1), -100)], dim=1)   # t_{j+2}
    label = _relabel(label, remap)                        # its draft-vocabulary column
    j = torch.arange(n, device=tok.device)
    in_answer = j[None] >= (answer_starts[:, None] - 2)
    out = []
    feat_in = head.target_feature(feats[:, :-1].float())  # [B, n, h]
    for step, f in enumerate(ttt_features(head, e, feat_in, ttt_steps)):
        valid = (label >= 0) & in_answer & (j[None] >= step)
        rows = valid.sum()                                # stays on the device: no sync
        logits = F.linear(f[valid], lm_w)
        ce = F.cross_entropy(logits, label[valid], reduction="sum") / rows.clamp_min(1)
        reg = 0.0
        if not head.shape.taps:
            reg = F.smooth_l1_loss(f[valid].float(), target_f[valid],
                                   reduction="sum") / (rows.clamp_min(1) * f.shape[-1])
        hits = (logits.argmax(-1) == label[valid]).sum()
        out.append((ce + 0.1 * reg, hits, rows))
    return out


def train_eagle(lm_w: torch.Tensor, emb_w: torch.Tensor, s: Samples, model_config,
                epochs: int = 6, lr: float = 1e-3, ttt_steps: int = 3, batch_tokens: int = 16384,
                intermediate_size: int | None = None, log=print, checkpoint=None,
                vocab: torch.Tensor | None = None, parallel: bool = False,
                init: EagleHead | None = None, init_lr_scale: float = 0.0,
                feature_layers: tuple[int, ...] = ()) -> EagleHead:
    """vocab: the draft vocabulary (None: all tokens); feature_layers: the
    target layers an EAGLE-3 head fuses (the samples' features carry them; ():
    the final hidden state; a head started from `init` keeps init's); parallel: a head for
    parallel drafting (placeholders, spec/peagle.py); init: a trained head to
    start from (its weights; placeholders start fresh). A parallel head started
    from one trains its placeholders at `lr` and the layer at `lr * init_lr_scale`
    (default 0: frozen, keeping what it learned on far more data; fine-tuning it
    at 2e-3 on a small set lost half its top-1 at depth 1)."""
    dev = s.features.device
    lm_w, remap = restrict(lm_w, vocab)
    remap = None if remap is None else remap.to(dev)
    tr, va = split(s)
    if init is not None:
        feature_layers = init.shape.taps
    shape = eagle_shape_for(model_config, init.shape.intermediate_size if init is not None
                            else intermediate_size, feature_layers)
    width = (1 + len(shape.taps)) * shape.hidden_size
    if s.features.shape[-1] != width:
        raise ValueError(f"the samples' features have {s.features.shape[-1]} columns; a head "
                         f"reading layers {shape.taps or 'final'} needs {width}")
    head = EagleHead(dataclasses.replace(shape, parallel=int(parallel))).to(dev)
    if init is not None:
        state = {k: v for k, v in init.state_dict().items() if not k.startswith("mask_")}
        head.load_state_dict(state, strict=False)
    if parallel:   # placeholders start at the average feature and token embedding
        with torch.no_grad():
            head.mask_feat.copy_(head.target_feature(s.features[:65536].float().to(dev)).mean(0))
            head.mask_emb.copy_(emb_w[s.tokens[:65536].to(emb_w.device)].float().mean(0).to(dev))
    # Rotary tables stay fp32 buffers; the head's weights train in fp32 under autocast.
    wdt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    w, emb = lm_w.to(dev, wdt).clone(), emb_w.to(dev, wdt).clone()   # normal tensors
    params = list(head.parameters())
    param_groups = [dict(params=params, lr=lr)]
    if parallel and init is not None:
        masks = [head.mask_emb, head.mask_feat]
        rest = [p for p in params if all(p is not m for m in masks)]
        params = masks + (rest if init_lr_scale > 0 else [])
        param_groups = [dict(params=masks, lr=lr)] + (
            [dict(params=rest, lr=lr * init_lr_scale)] if init_lr_scale > 0 else [])
    opt = torch.optim.AdamW(param_groups, lr=lr, weight_decay=0.0)
    groups = eagle_batches(s, tr, batch_tokens, shuffle=False)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, [g["lr"] for g in param_groups],
                                                total_steps=epochs * len(groups), pct_start=0.1)
    weights = [0.8 ** i for i in range(ttt_steps)]
    with _bar(epochs * len(groups), "peagle" if parallel else "eagle") as bar:
        for epoch in range(epochs):
            for group in eagle_batches(s, tr, batch_tokens, shuffle=True):
                tok, feats, a = _pad(s, group, dev)
                with autocast(dev):
                    res = eagle_passes(head, emb, w, tok, feats, a, ttt_steps, remap)
                    loss = sum(wt * r[0] for wt, r in zip(weights, res)) / sum(weights)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                sched.step()
                bar.update(1)
            acc = eagle_accuracy(head, emb, w, s, va or tr[:64], ttt_steps, batch_tokens, remap)
            log(f"{'peagle' if parallel else 'eagle'} epoch {epoch + 1}/{epochs}: loss {loss.item():.3f}, "
                f"held-out top-1 by depth {[round(x, 3) for x in acc]}")
            if checkpoint is not None:
                checkpoint(head)
    return head.requires_grad_(False).eval()


@torch.no_grad()
def eagle_accuracy(head, emb, w, s: Samples, seqs: list[int], ttt_steps: int,
                   batch_tokens: int, remap: torch.Tensor | None = None) -> list[float]:
    """Top-1 agreement with the target at each drafting depth (teacher-forced
    tokens, the head's own features): a proxy for acceptance by depth."""
    hits, rows = [0] * ttt_steps, [0] * ttt_steps
    dev = s.features.device
    for group in eagle_batches(s, seqs, batch_tokens, shuffle=False):
        tok, feats, a = _pad(s, group, dev)
        with autocast(dev):
            res = eagle_passes(head, emb, w, tok, feats, a, ttt_steps, remap)
        for i, (_, h, n) in enumerate(res):
            hits[i] += int(h)
            rows[i] += int(n)
    return [h / max(n, 1) for h, n in zip(hits, rows)]

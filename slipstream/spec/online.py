"""Online adaptation of an EAGLE head (Online Speculative Decoding): while the
engine serves, the head keeps training on what the target produced.

The proposer (spec/eagle.py) already runs the head over every real pair
(f_j, t_{j+1}) of a speculating request: the target's rows and the tokens.
With adaptation on it also records them, per request and in order (pairs run
right after verification carry a validity mask: only the accepted ones are
real). When a request ends, its pairs join a buffer; once the buffer holds
`every` pairs, the head takes `steps` AdamW steps on them with the loss it
was trained with (spec/train.py: `eagle_passes`, training-time-test passes,
cross-entropy through the target's frozen LM head over the draft
vocabulary), on an fp32 master copy, and the drafting head's weights are
overwritten in place (so CUDA graphs that read them see the new values).

Drafts stay drafts: verification keeps the output exactly the target's
whatever the head does, so adaptation can only move acceptance. The update
runs on the engine's thread between steps (a few milliseconds on a GPU for
the default model; longer on a CPU), and `stats` reports updates, pairs
and the last loss. The EAGLE device loop (`speculative_device_loop`, one
greedy prompt with every round in a CUDA graph) reads the head as it stands
and records nothing: adaptation happens on the engine's own path.
"""
from __future__ import annotations

import copy

import torch

from slipstream.spec.eagle_head import EagleHead


class OnlineAdapter:
    def __init__(self, head: EagleHead, master: EagleHead, embed, lm_head, lr: float = 1e-4,
                 every: int = 2048, steps: int = 4, ttt_steps: int = 3):
        """head: the drafting head (updated in place); master: the same head in
        fp32 with plain linear layers (the file loaded again: a CPU drafting head
        holds Q8_0 layers); embed: the target's token embedding module; lm_head:
        the DraftLMHead the head drafts with."""
        self.head, self.embed, self.lm_head = head, embed, lm_head
        self.every, self.steps, self.ttt_steps = every, steps, ttt_steps
        dev = head.device
        with torch.inference_mode(False):
            self.master = copy.deepcopy(master).float().requires_grad_(True).train()
            self.master.qkv_weight = None        # training reads q, k, v themselves
            self.opt = torch.optim.AdamW(self.master.parameters(), lr=lr, weight_decay=0.0)
        self.pending: dict[str, list] = {}       # request id -> [(pos0, tokens, rows, valid)]
        self.buffer: list[tuple[torch.Tensor, torch.Tensor]] = []   # (tokens [n + 1], rows [n, W])
        self.buffered = 0
        self.stats = dict(updates=0, pairs=0, last_loss=None)
        self._lm = None                          # (LM rows [V', h] fp32, token -> column)
        self.device = dev

    # ---- recording -------------------------------------------------------------

    def record(self, rid: str, pos0: int | torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor,
               valid: torch.Tensor | None = None) -> None:
        """Pairs at positions pos0, pos0 + 1, ...: tokens [t] (t_{j+1}), target
        rows [t, W] (f_j); valid [t] bool (None: all real). Device tensors are
        kept as they are (no host sync here)."""
        self.pending.setdefault(rid, []).append((pos0, tokens.detach(), rows.detach(), valid))

    def finish(self, rid: str) -> None:
        """The request ended: its pairs join the buffer; train when it is full."""
        parts = self.pending.pop(rid, None)
        if not parts:
            return
        for tokens, rows in _segments(parts):
            if tokens.shape[0] >= 3:
                self.buffer.append((tokens, rows))
                self.buffered += tokens.shape[0]
        if self.buffered >= self.every:
            self.update()

    def drop(self, rid: str) -> None:
        self.pending.pop(rid, None)

    # ---- training --------------------------------------------------------------

    def update(self) -> None:
        from slipstream.spec.train import eagle_passes
        seqs, self.buffer, self.buffered = self.buffer, [], 0
        seqs = seqs[-64:]
        with torch.inference_mode(False), torch.enable_grad():
            lm_w, remap = self._lm_rows()
            tok, feats = _pad(seqs, self.device)
            e_w = self._emb_rows(tok)
            starts = torch.zeros(tok.shape[0], dtype=torch.int64, device=self.device)
            weights = [0.8 ** i for i in range(self.ttt_steps)]
            loss = None
            for _ in range(self.steps):
                res = eagle_passes(self.master, e_w, lm_w, tok, feats, starts, self.ttt_steps,
                                   remap)
                loss = sum(w * r[0] for w, r in zip(weights, res)) / sum(weights)
                self.opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(self.master.parameters(), 1.0)
                self.opt.step()
        self._publish()
        self.stats["updates"] += 1
        self.stats["pairs"] += sum(t.shape[0] for t, _ in seqs)
        self.stats["last_loss"] = round(float(loss), 4)

    def _lm_rows(self):
        """(LM head rows [V', h] fp32 the head drafts over, token id -> column or None)."""
        if self._lm is None:
            lm = self.lm_head
            vocab, w = getattr(lm, "vocab", None), getattr(lm, "weight", None)
            target = lm.target
            if w is None:   # no draft vocabulary: the target's whole head, read back once
                h = target.config.hidden_size
                eye = torch.eye(h, device=self.device, dtype=self.head.dtype)
                with torch.inference_mode():
                    w = target.compute_logits(eye).T
            remap = None
            if vocab is not None:
                remap = torch.full((target.config.vocab_size,), -100, dtype=torch.int64,
                                   device=self.device)
                remap[vocab.to(self.device)] = torch.arange(vocab.shape[0], device=self.device)
            self._lm = (w.float().clone(), remap)
        return self._lm

    def _emb_rows(self, tok: torch.Tensor) -> torch.Tensor:
        """A small embedding table for this batch's tokens: [V, h] rows only where
        used (F.embedding takes it as is)."""
        with torch.inference_mode():
            ids = tok.clamp_min(0).unique()
            rows = self.embed(ids).float()
        table = torch.zeros(int(ids.max()) + 1, rows.shape[1], device=self.device)
        table[ids] = rows.clone()
        return table

    def _publish(self) -> None:
        """The master's weights into the drafting head, in place (Q8_0 layers of a
        CPU drafting head are quantized again)."""
        from slipstream.spec.cpu_draft import QUANTIZED, QuantLinear
        head = self.head
        with torch.no_grad():
            src = dict(self.master.named_parameters())
            for name, p in head.named_parameters():
                p.copy_(src[name].to(p.dtype))
            if head.qkv_weight is not None:
                head.qkv_weight.copy_(torch.cat([head.q.weight, head.k.weight, head.v.weight]))
            for name in QUANTIZED:
                if isinstance(getattr(head, name, None), QuantLinear):
                    setattr(head, name, QuantLinear(getattr(self.master, name)))


def _segments(parts):
    """Recorded pieces -> runs of consecutive real pairs: (tokens [n + 1], rows [n, W])
    in `eagle_passes`' layout (pair j = (rows[j], tokens[j + 1]); tokens[0] unused)."""
    toks, rows, last = [], [], None
    out = []
    for pos0, t, r, valid in parts:
        if valid is not None:   # pairs run after verification: only the accepted prefix
            n = int(valid.sum())
            t, r = t[:n], r[:n]
        p0 = int(pos0)
        if last is not None and p0 != last:
            out.append((toks, rows))
            toks, rows = [], []
        toks.append(t)
        rows.append(r)
        last = p0 + t.shape[0]
    if toks:
        out.append((toks, rows))
    segs = []
    for ts, rs in out:
        t, r = torch.cat(ts), torch.cat(rs)
        segs.append((torch.cat([t.new_zeros(1), t]), r))
    return segs


def _pad(seqs, device) -> tuple[torch.Tensor, torch.Tensor]:
    """-> tokens [B, T + 1] (-100 past the end), rows [B, T + 1, W] (zeros past it)."""
    longest = max(t.shape[0] for t, _ in seqs)
    width = seqs[0][1].shape[1]
    tok = torch.full((len(seqs), longest), -100, dtype=torch.int64, device=device)
    feats = torch.zeros(len(seqs), longest, width, device=device)
    for i, (t, r) in enumerate(seqs):
        tok[i, :t.shape[0]] = t.to(device)
        feats[i, :r.shape[0]] = r.to(device).float()
    return tok, feats

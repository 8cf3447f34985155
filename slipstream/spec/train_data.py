"""Training data for draft heads: the target's own answers and its features.

1. Answers: every prompt (chat template applied) is answered greedily by the
   target through the engine (`LLM.generate`: continuous batching, CUDA
   graphs on a GPU), `ignore_eos` so that every answer has the same length.
2. Features: one forward of the target over each prompt + answer gives its
   final hidden state at every position. Many sequences are packed into one
   varlen forward (`features_of_many`), on the engine's own model (the weights
   the heads will read at run time), over a KV pool of the trainer's own.
   A check follows: at answer positions the target's argmax must be the next
   answer token (it produced them greedily), else the features are misaligned.
3. Branches (optional): at random points of an answer the target's second
   choice replaces its first, and the target answers greedily on from there
   (`branch_prefixes`, `answer_branches`); each branch is one more sequence
   whose answer starts after the swapped token, so every trained position
   still follows the target's greedy choice.

`Samples` holds everything packed: tokens [N], features [N, hidden] on the
training device, and per sequence its offset, length and answer start.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from slipstream.spec.draft_cache import DraftKVCache

PROMPTS = Path(__file__).parent / "data" / "train_prompts.txt"


@dataclass
class Samples:
    tokens: torch.Tensor     # [N] int64, all sequences back to back (prompt + answer)
    features: torch.Tensor   # [N, hidden], the target's final hidden states
    offsets: torch.Tensor    # [S] int64, first row of each sequence
    lengths: torch.Tensor    # [S] int64
    answer_starts: torch.Tensor  # [S] int64, first answer position within its sequence
    parents: torch.Tensor | None = None   # [S] int64, the answer a branch came from (None: itself)

    def __len__(self) -> int:
        return self.offsets.shape[0]

    @property
    def num_answer_tokens(self) -> int:
        return int((self.lengths - self.answer_starts).sum())

    def to(self, device) -> "Samples":
        return Samples(*(None if getattr(self, k) is None else getattr(self, k).to(device) for k in
                         ("tokens", "features", "offsets", "lengths", "answer_starts", "parents")))

    @classmethod
    def pack(cls, seqs: list[torch.Tensor], features: list[torch.Tensor],
             answer_starts: list[int], parents: list[int] | None = None) -> "Samples":
        lengths = torch.tensor([s.shape[0] for s in seqs])
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])
        return cls(torch.cat(seqs).cpu(), torch.cat(features), offsets, lengths,
                   torch.tensor(answer_starts), None if parents is None else torch.tensor(parents))


def read_prompts(path: str | Path | None = None) -> list[str]:
    lines = Path(path or PROMPTS).read_text().splitlines()
    return [s.strip() for s in lines if s.strip()]


def answer_prompts(llm, prompts: list[str], max_tokens: int) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, greedy answer ids) per prompt, through the engine."""
    from slipstream.sampling_params import SamplingParams
    tok = llm.get_tokenizer()
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]),
                      add_special_tokens=False) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=True)
    return ids, [list(o.outputs[0].token_ids) for o in outs]


@torch.inference_mode()
def branch_prefixes(model, seqs: list[torch.Tensor], feats: list[torch.Tensor],
                    answer_starts: list[int], branches: int, within: int,
                    generator: torch.Generator) -> tuple[list[list[int]], list[int]]:
    """Where the target's greedy answers could have gone: for each sequence,
    `branches` random answer positions p among its first `within` answer
    tokens, and at each the target's second choice b there (the top-2 of its
    logits at p - 1 other than the token it chose). Returns the prefixes
    tokens[:p] + [b] and the sequence each came from. Answered greedily from
    there, they give contexts a greedy answer reaches only through a near-tie,
    so a head trained on them sees more of what the target writes."""
    picks = []                                            # (sequence, position)
    for q, (s, a) in enumerate(zip(seqs, answer_starts)):
        span = min(within, s.shape[0] - 1 - a)
        if span < 1:
            continue
        at = torch.randperm(span, generator=generator)[:branches] + a
        picks.extend((q, int(p)) for p in at)
    if not picks:
        return [], []
    dev = next(model.parameters()).device
    out = []
    for start in range(0, len(picks), 4096):
        chunk = picks[start:start + 4096]
        rows = torch.stack([feats[q][p - 1] for q, p in chunk]).to(dev, _act_dtype(model))
        top2 = model.compute_logits(rows).topk(2, dim=-1).indices.cpu()
        for (q, p), (first, second) in zip(chunk, top2.tolist()):
            chosen = int(seqs[q][p])
            out.append(seqs[q][:p].tolist() + [second if first == chosen else first])
    return out, [q for q, _ in picks]


def answer_branches(llm, prefixes: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy answers (`max_tokens` each, `ignore_eos`) that continue the prefixes."""
    from slipstream.sampling_params import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prefixes], params, use_tqdm=True)
    return [list(o.outputs[0].token_ids) for o in outs]


@torch.inference_mode()
def features_of_many(model, seqs: list[torch.Tensor], max_tokens_per_forward: int = 16384,
                     progress=None) -> list[torch.Tensor]:
    """seqs: [T_i] int64 each -> the target's final hidden states [T_i, hidden]
    (the model's dtype, on its device), many sequences per forward."""
    param = next(model.parameters())
    device = param.device
    dtype = torch.get_default_dtype() if param.dtype == torch.uint8 else param.dtype
    bs, max_seqs = 16, 1024
    longest = max(s.shape[0] for s in seqs)
    budget = max(max_tokens_per_forward, longest)
    # Each sequence wastes at most one partial block. The cache binds the model's
    # attention layers to its own pool: the engine's caches are put back at the end, so
    # the engine that owns the model can go on generating.
    engine_caches = [(layer.k_cache, layer.v_cache) for layer in model.attention_layers()]
    try:
        cache = DraftKVCache(model, budget // bs + min(max_seqs, len(seqs)) + 1, bs,
                             _cache_dtype(model, dtype), device)
        return _forward_packed(model, cache, seqs, budget, max_seqs, progress)
    finally:
        for layer, (k, v) in zip(model.attention_layers(), engine_caches):
            layer.k_cache, layer.v_cache = k, v


def _forward_packed(model, cache, seqs, budget, max_seqs, progress) -> list[torch.Tensor]:
    device = cache.device
    out: list[torch.Tensor | None] = [None] * len(seqs)
    order = sorted(range(len(seqs)), key=lambda i: -seqs[i].shape[0])
    i = 0
    while i < len(order):
        chunk, n = [], 0
        while (i < len(order) and len(chunk) < max_seqs
               and (not chunk or n + seqs[order[i]].shape[0] <= budget)):
            chunk.append(order[i])
            n += seqs[order[i]].shape[0]
            i += 1
        entries = [(f"s{j}", seqs[j].to(device), 0, None) for j in chunk]
        batch = cache.batch(entries)
        model.backend.prepare(batch)
        hidden = model(batch)
        at = 0
        for j in chunk:
            t = seqs[j].shape[0]
            out[j] = hidden[at:at + t].clone()
            at += t
            cache.release(f"s{j}")
        if progress is not None:
            progress(len(chunk))
    return out


def _cache_dtype(model, dtype: torch.dtype) -> torch.dtype:
    layer = model.attention_layers()[0]
    kc = getattr(layer, "k_cache", None)
    return kc.dtype if isinstance(kc, torch.Tensor) and kc.numel() else dtype


def features_of(model, tokens: torch.Tensor) -> torch.Tensor:
    """tokens: [T] -> the target's final hidden states [T, hidden] float32 (CPU)."""
    return features_of_many(model, [tokens])[0].float().cpu()


@torch.inference_mode()
def check_alignment(model, s: Samples, max_rows: int = 4096) -> float:
    """Fraction of answer positions (up to max_rows) where the target's argmax
    over the feature at position j is token j + 1: ~1 for greedy answers."""
    rows = []
    for off, ln, a in zip(s.offsets.tolist(), s.lengths.tolist(), s.answer_starts.tolist()):
        rows.extend(range(off + a, off + ln - 1))
        if len(rows) >= max_rows:
            break
    rows = torch.tensor(rows[:max_rows])
    feats = s.features[rows.to(s.features.device)]
    dev = next(model.parameters()).device
    logits = model.compute_logits(feats.to(dev, _act_dtype(model)))
    return (logits.argmax(-1).cpu() == s.tokens[rows + 1]).float().mean().item()


def _act_dtype(model) -> torch.dtype:
    p = next(model.parameters())
    return torch.get_default_dtype() if p.dtype == torch.uint8 else p.dtype


@torch.inference_mode()
def dense_output_weights(model) -> tuple[torch.Tensor, torch.Tensor]:
    """(LM head [V, hidden], token embeddings [V, hidden]) as dense float32
    matrices, whatever the model stores (dense or quantized blocks): the LM
    head is read back as its outputs on the identity, the embeddings by looking
    every token up."""
    dev = next(model.parameters()).device
    h = model.config.hidden_size
    eye = torch.eye(h, device=dev, dtype=_act_dtype(model))
    lm = model.compute_logits(eye).float().T.contiguous()                   # [V, h]
    vocab = lm.shape[0]
    emb = torch.cat([model.model.embed_tokens(torch.arange(s, min(s + 8192, vocab), device=dev))
                     for s in range(0, vocab, 8192)]).float()
    return lm, emb


def eagle_batches(s: Samples, seqs: list[int], batch_tokens: int, shuffle: bool):
    """Groups of sequences of similar length, about batch_tokens padded tokens each."""
    order = sorted(seqs, key=lambda q: int(s.lengths[q]))
    groups, cur, longest = [], [], 0
    for q in order:
        ln = int(s.lengths[q])
        if cur and max(longest, ln) * (len(cur) + 1) > batch_tokens:
            groups.append(cur)
            cur, longest = [], 0
        cur.append(q)
        longest = max(longest, ln)
    if cur:
        groups.append(cur)
    if shuffle:
        groups = [groups[i] for i in torch.randperm(len(groups)).tolist()]
    return groups


def pad_batch(s: Samples, group: list[int], dev) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> tokens [B, T] (-100 past the end), features [B, T, h], answer starts [B]."""
    t = max(int(s.lengths[q]) for q in group)
    tok = torch.full((len(group), t), -100, dtype=torch.int64)
    idx = torch.zeros(len(group), t, dtype=torch.int64)
    for i, q in enumerate(group):
        off, ln = int(s.offsets[q]), int(s.lengths[q])
        tok[i, :ln] = s.tokens[off:off + ln]
        idx[i, :ln] = torch.arange(off, off + ln)
        idx[i, ln:] = off + ln - 1
    return tok.to(dev), s.features[idx.to(s.features.device)], s.answer_starts[group].to(dev)

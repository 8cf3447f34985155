"""Training Medusa heads and the EAGLE head on the target's own outputs.

Data: each prompt (chat template applied) is answered by the target itself
(greedy), then one target forward over prompt + answer gives the final hidden
state at every position. Losses are taken on the answer only, where drafting
happens:
  Medusa head i: cross-entropy of lm_head(head_i(f_j)) against token j + 1 + i.
  EAGLE: from pairs (f_j, t_{j+1}) predict f_{j+1}: smooth-L1 to the real
    feature plus cross-entropy against the target's distribution at j + 1.
    Training-time test (EAGLE-3's idea): a second pass feeds the head its own
    predicted features in place of the real ones, the regime of drafting
    steps 2 and later, and adds its losses.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from slipstream.sampling_params import SamplingParams
from slipstream.spec.draft_cache import DraftKVCache
from slipstream.spec.eagle import EagleHead, EagleShape
from slipstream.spec.generator import SpeculativeGenerator
from slipstream.spec.medusa import MedusaHeads

PROMPTS = Path(__file__).parent / "data" / "train_prompts.txt"


@dataclass
class Sample:
    tokens: torch.Tensor    # [T] int64, prompt + answer
    features: torch.Tensor  # [T, hidden] float32, the target's final hidden states
    answer_start: int       # first answer position


def read_prompts(path: str | Path | None = None) -> list[str]:
    lines = Path(path or PROMPTS).read_text().splitlines()
    return [s.strip() for s in lines if s.strip()]


def make_samples(model, tokenizer, prompts: list[str], max_tokens: int = 128,
                 batch_size: int = 32, progress=None) -> list[Sample]:
    """Answer each prompt with the target (greedy) and record its features."""
    ids = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}]),
                            add_special_tokens=False) for p in prompts]
    longest = max(len(i) for i in ids) + max_tokens
    gen = SpeculativeGenerator(model, None, num_blocks=batch_size * -(-longest // 16) + 1,
                               block_size=16)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    samples = []
    for s in range(0, len(ids), batch_size):
        chunk = ids[s:s + batch_size]
        answers = gen.generate(chunk, params)
        for prompt, answer in zip(chunk, answers):
            tokens = torch.tensor(prompt + answer)
            samples.append(Sample(tokens, features_of(model, tokens), len(prompt)))
        if progress is not None:
            progress(len(chunk))
    return samples


@torch.inference_mode()
def features_of(model, tokens: torch.Tensor) -> torch.Tensor:
    """tokens: [T] -> the target's final hidden states [T, hidden] float32."""
    cache = DraftKVCache(model, -(-tokens.shape[0] // 16), 16,
                         next(model.parameters()).dtype, next(model.parameters()).device)
    batch = cache.batch([("x", tokens, 0, None)])
    model.backend.prepare(batch)
    return model(batch).float().cpu()


def _lm_weight(model) -> torch.Tensor:
    return model.lm_head.weight.detach().float().cpu()


def train_vocab(samples: list[Sample], model, extra: int = 1024) -> torch.Tensor:
    """The training softmax runs over a reduced vocabulary (as EAGLE-3's draft
    vocabulary does): every token of the data plus the `extra` tokens the LM
    head rates highest on average over the answers. Sorted ids [V']."""
    seen = torch.cat([s.tokens for s in samples]).unique()
    feats = torch.cat([s.features[s.answer_start:] for s in samples])
    mean_logits = (feats @ _lm_weight(model).T).mean(0)
    top = mean_logits.topk(min(extra, mean_logits.shape[0])).indices
    return torch.cat([seen, top]).unique()


def train_medusa(model, samples: list[Sample], num_heads: int = 3, epochs: int = 2,
                 lr: float = 1e-3, batch: int = 256, log=print) -> MedusaHeads:
    vocab = train_vocab(samples, model)
    w = _lm_weight(model)[vocab]
    remap = torch.full((model.config.vocab_size,), -100, dtype=torch.int64)
    remap[vocab] = torch.arange(vocab.shape[0])
    heads = MedusaHeads(w.shape[1], num_heads)
    opt = torch.optim.AdamW(heads.parameters(), lr=lr, weight_decay=0.0)
    xs, ys = [], []
    for s in samples:
        t = s.tokens.shape[0]
        for j in range(max(0, s.answer_start - 1), t - 2):
            xs.append(s.features[j])
            ys.append([s.tokens[j + 1 + i].item() if j + 1 + i < t else -100
                       for i in range(1, num_heads + 1)])
    x, y = torch.stack(xs), torch.tensor(ys)
    y = torch.where(y >= 0, remap[y.clamp_min(0)], -100)
    steps = epochs * math.ceil(x.shape[0] / batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, lr, total_steps=steps)
    step = 0
    for epoch in range(epochs):
        order = torch.randperm(x.shape[0])
        for b in range(0, x.shape[0], batch):
            idx = order[b:b + batch]
            logits = heads(x[idx]) @ w.T                          # [n, heads, V]
            loss = F.cross_entropy(logits.flatten(0, 1), y[idx].flatten(), ignore_index=-100)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            step += 1
        with torch.no_grad():
            acc = (heads(x[:2048]) @ w.T).argmax(-1).eq(y[:2048]).float().mean(0)
        log(f"medusa epoch {epoch + 1}/{epochs}: loss {loss.item():.3f}, "
            f"top-1 per head {[round(a, 3) for a in acc.tolist()]}")
    return heads.requires_grad_(False)


def eagle_shape_for(model, intermediate_size: int | None = None) -> EagleShape:
    c = model.config
    return EagleShape(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                      intermediate_size or c.intermediate_size, c.rope_theta,
                      c.max_position_embeddings, c.rms_norm_eps)


def train_eagle(model, samples: list[Sample], epochs: int = 4, lr: float = 1e-3,
                intermediate_size: int | None = None, ttt: bool = True, log=print) -> EagleHead:
    w = _lm_weight(model)[train_vocab(samples, model)]
    emb = model.model.embed_tokens.weight.detach().float().cpu()
    head = EagleHead(eagle_shape_for(model, intermediate_size))
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, lr, total_steps=epochs * len(samples))
    for epoch in range(epochs):
        tot, hits, n = 0.0, 0, 0
        for i in torch.randperm(len(samples)).tolist():
            s = samples[i]
            t = s.tokens.shape[0]
            feats, toks = s.features, s.tokens
            pos = torch.arange(t - 1)
            e = emb[toks[1:]]                                           # pair j: t_{j+1}
            target_f = feats[1:]                                        # f_{j+1}
            with torch.no_grad():
                target_p = (target_f @ w.T).softmax(-1)
            keep = pos >= max(0, s.answer_start - 2)
            f_hat, _, _ = head(e, feats[:-1], pos, None, None)
            loss = _eagle_loss(f_hat, target_f, target_p, w, keep)
            if ttt:
                # Pair j's feature is now the head's own guess at f_j (f_hat[j - 1]).
                fed = torch.cat([feats[:1], f_hat[:-1]])
                f2, _, _ = head(e, fed, pos, None, None)
                loss = loss + _eagle_loss(f2, target_f, target_p, w, keep)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            sched.step()
            with torch.no_grad():
                hits += ((f_hat[keep] @ w.T).argmax(-1) == target_p[keep].argmax(-1)).sum().item()
                n += int(keep.sum())
                tot += loss.item()
        log(f"eagle epoch {epoch + 1}/{epochs}: loss {tot / len(samples):.3f}, "
            f"next-token top-1 {hits / max(n, 1):.3f}")
    return head.requires_grad_(False).eval()


def _eagle_loss(f_hat, target_f, target_p, w, keep) -> torch.Tensor:
    logp = torch.log_softmax(f_hat[keep] @ w.T, -1)
    ce = -(target_p[keep] * logp).sum(-1).mean()
    return F.smooth_l1_loss(f_hat[keep], target_f[keep]) + 0.1 * ce


def train_draft(methods: list[str], model_path: str | None, out_dir: str | Path,
                prompts: str | None, max_tokens: int, epochs: int, seed: int = 0,
                log=print, data_cache: str | None = None) -> list[Path]:
    """The `slipstream train-draft` command: data (once), training, safetensors."""
    from slipstream.loader import open_model
    from slipstream.spec.draft_model import load_draft_model
    for method in methods:
        if method not in ("medusa", "eagle"):
            raise ValueError(f"method: train-draft trains 'medusa' or 'eagle', got {method!r}")
    torch.manual_seed(seed)
    files = open_model(model_path)
    model = load_draft_model(model_path, "cpu", torch.float32)
    texts = read_prompts(prompts)
    t0 = time.perf_counter()
    key = dict(model=str(files.path), prompts=texts, max_tokens=max_tokens)
    cached = Path(data_cache) if data_cache else None
    samples = None
    if cached is not None and cached.is_file():
        blob = torch.load(cached, weights_only=True)
        if blob["key"] == repr(key):
            samples = [Sample(t, f, int(a)) for t, f, a in blob["samples"]]
            log(f"samples from {cached}")
    if samples is None:
        from tqdm.auto import tqdm
        with tqdm(total=len(texts), desc="target answers") as bar:
            samples = make_samples(model, files.tokenizer(), texts, max_tokens, progress=bar.update)
        if cached is not None:
            torch.save({"key": repr(key), "samples": [(s.tokens, s.features, s.answer_start)
                                                        for s in samples]}, cached)
    log(f"{len(samples)} samples, {sum(s.tokens.shape[0] - s.answer_start for s in samples)} "
        f"answer tokens in {time.perf_counter() - t0:.0f} s")
    stem = Path(model_path).stem if model_path else "smollm2-135m-instruct"
    outs = []
    for method in methods:
        t0 = time.perf_counter()
        if method == "medusa":
            trained = train_medusa(model, samples, epochs=epochs, log=log)
        else:
            trained = train_eagle(model, samples, epochs=epochs, log=log)
        out = Path(out_dir) / f"{stem}.{method}.safetensors"
        out.parent.mkdir(parents=True, exist_ok=True)
        trained.save(out)
        log(f"wrote {out} ({time.perf_counter() - t0:.0f} s of training)")
        outs.append(out)
    return outs

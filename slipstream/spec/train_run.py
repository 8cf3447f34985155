"""`slipstream train-draft`: data (once, optionally cached), training, safetensors.

On a GPU the whole run (answers through the engine, packed feature forwards,
both heads trained in large bf16-autocast batches) takes minutes; on a CPU it
works too with small settings (`--num-prompts`, `--max-tokens`).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from slipstream.spec import train as T
from slipstream.spec.heads import top_tokens
from slipstream.spec.train_data import (Samples, answer_branches, answer_prompts,
                                        branch_prefixes, check_alignment,
                                        dense_output_weights, features_of_many, read_prompts)


def _engine(model_path, device: str, max_len: int, max_num_seqs: int, seed: int):
    from slipstream import LLM
    opts = dict(device=device, max_model_len=max_len, seed=seed, max_num_seqs=max_num_seqs)
    if device == "cpu":
        opts["kv_cache_memory"] = 256 << 20
    else:
        opts["gpu_memory_utilization"] = 0.3     # the rest: features and training
    return LLM(model_path, **opts)


def make_samples(model_path, prompts: list[str], max_tokens: int, device: str, seed: int = 0,
                 max_num_seqs: int = 256, log=print, feature_layers: str = "final", init=None,
                 branches: int = 0, branch_tokens: int = 0):
    """-> (Samples on `device`, model config, LM head [V, h], embeddings [V, h]);
    the features hold the target's final hidden states, then the outputs of
    the layers `feature_layers` names (`feature_taps`; an EAGLE-3 head's input).
    branches: per answer, this many more sequences that take the target's
    second choice at a random point of the answer's first half and go on
    greedily for `branch_tokens` tokens (train_data.branch_prefixes)."""
    t0 = time.perf_counter()
    # Characters bound a prompt's tokens; 128 for the chat template around it (a system
    # prompt included).
    longest = 128 + max(len(p) for p in prompts) + max_tokens + (branch_tokens if branches else 0)
    llm = _engine(model_path, device, longest, max_num_seqs, seed)
    ids, answers = answer_prompts(llm, prompts, max_tokens)
    t1 = time.perf_counter()
    log(f"answers: {len(ids)} prompts x {max_tokens} tokens in {t1 - t0:.1f} s "
        f"(engine load included)")
    model = llm.engine.runner.model
    taps = feature_taps(feature_layers, model.config.num_hidden_layers, init)
    model.set_feature_taps(taps)
    seqs = [torch.tensor(p + a) for p, a in zip(ids, answers)]
    starts = [len(p) for p in ids]
    try:
        feats = features_of_many(model, seqs)
        agree = _alignment(model, seqs, feats, starts)
    except Exception as e:     # noqa: BLE001 - retried once below
        log(f"features with the {model.backend.name} attention backend failed: {e!r}")
        agree, feats = 0.0, None
    if agree < 0.5 and model.backend.name != "torch":
        # One retry on the plain PyTorch attention backend.
        from slipstream.attention.selector import create_backend
        log(f"features: agreement {agree:.3f}; retrying with the torch attention backend")
        model.backend = create_backend("torch", next(model.parameters()).device)
        for layer in model.attention_layers():
            layer.backend = model.backend
        feats = features_of_many(model, seqs)
        agree = _alignment(model, seqs, feats, starts)
    if agree < 0.5:
        raise RuntimeError(f"features do not line up with the answers ({agree:.3f} agreement)")
    log(f"features: {sum(s.shape[0] for s in seqs)} positions in {time.perf_counter() - t1:.1f} s; "
        f"target argmax = next answer token at {agree:.3f} of answer positions")
    if branches > 0 and branch_tokens >= 2:
        t2 = time.perf_counter()
        gen = torch.Generator().manual_seed(seed)
        prefixes, parents = branch_prefixes(model, seqs, feats, starts, branches,
                                            max(1, max_tokens // 2), gen)
        model.set_feature_taps(())      # the engine's steps (and CUDA graphs) as captured
        more = answer_branches(llm, prefixes, branch_tokens)
        model.set_feature_taps(taps)
        extra = [torch.tensor(p + a) for p, a in zip(prefixes, more)]
        parents = list(range(len(seqs))) + parents
        seqs, starts = seqs + extra, starts + [len(p) + 1 for p in prefixes]
        feats = feats + features_of_many(model, extra)
        log(f"branches: {len(extra)} x {branch_tokens} tokens in {time.perf_counter() - t2:.1f} s")
    else:
        parents = None
    samples = Samples.pack(seqs, feats, starts, parents)
    del feats
    lm_w, emb_w = dense_output_weights(model)
    config = model.config
    del llm, model
    if device != "cpu":
        torch.cuda.empty_cache()
    return samples, config, lm_w, emb_w


def _alignment(model, seqs, feats, starts, max_rows: int = 4096) -> float:
    """check_alignment over the first sequences that hold max_rows answer positions
    (packing them all would copy every feature once more)."""
    k, rows = 0, 0
    while k < len(seqs) and rows < max_rows:
        rows += seqs[k].shape[0] - 1 - starts[k]
        k += 1
    return check_alignment(model, Samples.pack(seqs[:k], feats[:k], starts[:k]), max_rows)


def train_draft(methods: list[str], model_path: str | None, out_dir: str | Path,
                prompts: str | None, max_tokens: int, epochs: int, seed: int = 0, log=print,
                data_cache: str | None = None, device: str = "auto",
                num_prompts: int | None = None, medusa_epochs: int | None = None,
                ttt_steps: int = 3, batch_tokens: int = 16384, lr: float = 1e-3,
                max_num_seqs: int = 256, draft_vocab: int = 16384,
                init_head: str | None = None, init_lr_scale: float = 0.0,
                feature_layers: str = "eagle3", branches: int = 0,
                branch_tokens: int = 0) -> list[Path]:
    """init_head: an EAGLE head file the eagle / peagle heads start from (its draft
    vocabulary and feature layers are kept); init_lr_scale: a peagle head's layer
    then trains at this fraction of lr (0: only the placeholders train);
    feature_layers: what an EAGLE head reads of the target: "eagle3" (a low, a
    middle and a high layer, fused), "final" (the final hidden state, EAGLE-1/2)
    or decoder-layer indices "2,15,27"; branches, branch_tokens: more sequences
    that branch off each answer at the target's second choice (make_samples)."""
    for method in methods:
        if method not in ("medusa", "eagle", "peagle"):
            raise ValueError(f"method: train-draft trains 'medusa', 'eagle' or 'peagle', "
                             f"got {method!r}")
    if "peagle" in methods and ttt_steps < 3:
        raise ValueError("--method peagle trains its placeholders from the third "
                         "training-time-test pass on: --ttt-steps must be at least 3 (one "
                         "more than the blind drafts wanted)")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(seed)
    texts = read_prompts(prompts)
    texts = texts[:num_prompts] if num_prompts else texts
    t_start = time.perf_counter()
    init = None
    if init_head:
        from slipstream.spec.eagle_head import EagleHead
        init = EagleHead.load(init_head, device, torch.float32)
    key = repr(dict(model=str(model_path), prompts=texts, max_tokens=max_tokens,
                    features=init.shape.feature_layers if init is not None else feature_layers,
                    branches=branches, branch_tokens=branch_tokens, seed=seed))
    cached = Path(data_cache) if data_cache else None
    samples = None
    if cached is not None and cached.is_file():
        blob = torch.load(cached, weights_only=False)
        if blob["key"] == key:
            samples, config, lm_w, emb_w = blob["data"]
            samples = samples.to(device)
            log(f"samples from {cached}")
    if samples is None:
        samples, config, lm_w, emb_w = make_samples(model_path, texts, max_tokens, device, seed,
                                                    max_num_seqs, log, feature_layers, init,
                                                    branches, branch_tokens)
        if cached is not None:
            torch.save({"key": key, "data": (samples.to("cpu"), config, lm_w.cpu(), emb_w.cpu())},
                       cached)
    t_data = time.perf_counter() - t_start
    taps = feature_taps(feature_layers, config.num_hidden_layers, init)
    log(f"{len(samples)} samples, {samples.num_answer_tokens} answer tokens ({t_data:.0f} s)")
    stem = Path(model_path).stem.lower() if model_path else "smollm2-135m-instruct"
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = dict(device=device, prompts=len(texts), max_tokens=max_tokens,
                  branches=branches, branch_tokens=branch_tokens, sequences=len(samples),
                  answer_tokens=samples.num_answer_tokens, data_seconds=round(t_data, 1),
                  epochs=epochs, medusa_epochs=medusa_epochs or max(1, epochs // 2),
                  ttt_steps=ttt_steps, batch_tokens=batch_tokens, lr=lr, seed=seed,
                  feature_layers=list(taps) or "final", log=[])

    def logged(msg: str) -> None:
        report["log"].append(msg)
        if log is print:    # between progress-bar updates, on the bar's stream
            from tqdm.auto import tqdm
            tqdm.write(msg, file=sys.stderr)
        else:
            log(msg)

    vocab = None
    if init_head:
        from slipstream.spec.heads import read_draft_vocab
        vocab = read_draft_vocab(init_head)
        report["init_head"], report["init_lr_scale"] = str(init_head), init_lr_scale
        logged(f"starting from {init_head}" + ("" if vocab is None else
                                                f" (its draft vocabulary: {vocab.shape[0]} tokens)"))
    elif draft_vocab:
        answers = torch.cat([samples.tokens[o + a:o + n] for o, n, a in zip(
            samples.offsets.tolist(), samples.lengths.tolist(), samples.answer_starts.tolist())])
        vocab, cover = top_tokens(answers, draft_vocab, lm_w.shape[0])
        report["draft_vocab"], report["draft_vocab_coverage"] = vocab.shape[0], round(cover, 5)
        logged(f"draft vocabulary: {vocab.shape[0]} tokens cover {cover:.4f} of answer tokens")
    outs = []
    for method in methods:
        t0 = time.perf_counter()
        out = out_dir / f"{stem}.{method}.safetensors"
        save = (lambda m, out=out: m.save(out, vocab))
        if method == "medusa":
            T.train_medusa(lm_w, samples, epochs=report["medusa_epochs"], lr=lr, log=logged,
                           checkpoint=save, vocab=vocab)
        else:
            T.train_eagle(lm_w, emb_w, samples, config, epochs=epochs, lr=lr,
                          ttt_steps=ttt_steps, batch_tokens=batch_tokens, log=logged,
                          checkpoint=save, vocab=vocab, parallel=method == "peagle",
                          init=init, init_lr_scale=init_lr_scale, feature_layers=taps)
        report[f"{method}_seconds"] = round(time.perf_counter() - t0, 1)
        logged(f"wrote {out} ({time.perf_counter() - t0:.0f} s of training)")
        outs.append(out)
    report["total_seconds"] = round(time.perf_counter() - t_start, 1)
    (out_dir / f"{stem}.train.json").write_text(json.dumps(report, indent=1))
    return outs


def feature_taps(spec: str, num_layers: int, init=None) -> tuple[int, ...]:
    """--feature-layers of a target with `num_layers` layers -> ascending
    decoder-layer indices (() for "final"); a head started from `init` reads
    what init reads."""
    if init is not None:
        return init.shape.taps
    if spec == "final":
        return ()
    if spec == "eagle3":
        from slipstream.spec.eagle_head import eagle3_layers
        return eagle3_layers(num_layers)
    try:
        return tuple(sorted({int(i) for i in spec.split(",") if i.strip()}))
    except ValueError:
        raise ValueError(f"--feature-layers: 'eagle3', 'final' or layer indices like '2,15,27', "
                         f"got {spec!r}") from None

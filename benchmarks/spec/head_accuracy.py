"""How well EAGLE heads predict the target on prompts they were not trained on.

The target answers each prompt greedily; then, teacher-forced on those answers, each
head's top-1 agreement with the target at each drafting depth is counted exactly as
train-draft's held-out figure is (`train.eagle_accuracy`: the head's own features for
the drafted depths). Two prompt sets: the benchmark's chat prompts
(benchmarks/spec/prompts.txt, never trained on) and a sample of the training prompts,
so the gap between them shows what the head learned about its training prompts only.

    python benchmarks/spec/head_accuracy.py --eagle-head A.safetensors --eagle-head B.safetensors \\
        [--device cpu] [--max-tokens 96] [--depths 6] [--out DIR]

Writes DIR/head_accuracy.{json,md}.
"""
from __future__ import annotations

import argparse
import datetime
import json
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--eagle-head", action="append", default=None,
                    help="head file (repeatable; default: the shipped EAGLE head)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--depths", type=int, default=6)
    ap.add_argument("--train-sample", type=int, default=12,
                    help="training prompts sampled for the comparison row")
    ap.add_argument("--out", default=str(HERE / "results"))
    args = ap.parse_args(argv)
    import torch
    from slipstream.spec import train as T
    from slipstream.spec.eagle_head import EagleHead
    from slipstream.spec.heads import SHIPPED, SHIPPED_DIR, read_draft_vocab
    from slipstream.spec.train_data import read_prompts
    from slipstream.spec.train_run import make_samples
    heads = args.eagle_head or [str(SHIPPED_DIR / SHIPPED["eagle"])]
    sets = {"benchmark prompts": read_prompts(HERE / "prompts.txt"),
            "training prompts": random.Random(1).sample(read_prompts(), args.train_sample)}
    loaded = [(h, EagleHead.load(h, args.device, torch.float32), read_draft_vocab(h)) for h in heads]
    taps = {tuple(head.shape.taps) for _, head, _ in loaded}
    rows = []
    for set_name, prompts in sets.items():
        data = {}
        for t in taps:   # one pass of the target per feature-layer set
            head = next(hd for _, hd, _ in loaded if tuple(hd.shape.taps) == t)
            data[t] = make_samples(None, prompts, args.max_tokens, args.device, 0, 16,
                                   lambda *a: None, "final" if not t else "eagle3", head)
        for path, head, vocab in loaded:
            s, _, lm_w, emb_w = data[tuple(head.shape.taps)]
            w, remap = T.restrict(lm_w, vocab)
            dev = s.features.device
            acc = T.eagle_accuracy(head, emb_w.to(dev).float(), w.to(dev).float(), s,
                                   list(range(len(s))), args.depths, 16384,
                                   None if remap is None else remap.to(dev))
            rows.append({"prompts": set_name, "head": Path(path).name, "path": str(path),
                         "top1_by_depth": [round(a, 4) for a in acc]})
            print(f"{set_name:18s} {Path(path).name}: {[round(a, 3) for a in acc]}", flush=True)
    meta = {"date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": args.device, "torch": torch.__version__, "max_tokens": args.max_tokens,
            "prompts": {k: len(v) for k, v in sets.items()}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "head_accuracy.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"# EAGLE heads: top-1 agreement with the target by drafting depth ({args.device})", "",
             f"{meta['date_utc']}, torch {meta['torch']}, greedy answers of {args.max_tokens} tokens, "
             "teacher-forced (train-draft's held-out measure).", "",
             "| prompts | head | top-1 by depth |", "| --- | --- | --- |"]
    lines += [f"| {r['prompts']} ({meta['prompts'][r['prompts']]}) | {r['head']} | "
              f"{' / '.join(f'{a:.3f}' for a in r['top1_by_depth'])} |" for r in rows]
    (out / "head_accuracy.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

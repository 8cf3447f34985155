"""Are the EAGLE head's hits independent from one position to the next?

Teacher-forced on the target's greedy answers (as `head_accuracy.py` and
train-draft's held-out figure), the head's depth-1 top-1 hit at every answer
position, then: the overall rate, the rate right after a hit and right after a
miss. A speculation round starts after a rejected draft (a miss) unless it
accepted every draft, so if misses cluster, the depth-1 acceptance counted in
rounds sits below the teacher-forced rate without anything being wrong.

    python benchmarks/spec/acceptance_runs.py [--device cpu] [--max-tokens 96] [--out DIR]

Writes DIR/acceptance_runs.{json,md}.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))


def depth1_hits(head, emb_w, lm_w, s, remap, batch_tokens: int = 16384):
    """-> list of per-answer hit sequences (bool lists, answer positions in order)."""
    import torch
    import torch.nn.functional as F
    from slipstream.spec import train as T
    out = []
    dev = s.features.device
    for group in T.eagle_batches(s, list(range(len(s))), batch_tokens, shuffle=False):
        tok, feats, starts = T._pad(s, group, dev)
        b, t = tok.shape
        n = t - 1
        e = F.embedding(tok[:, 1:].clamp_min(0), emb_w)
        label = T._relabel(torch.cat([tok[:, 2:], tok.new_full((b, 1), -100)], dim=1), remap)
        j = torch.arange(n, device=dev)
        valid = (label >= 0) & (j[None] >= (starts[:, None] - 2))
        with torch.no_grad():
            f = next(iter(T.ttt_features(head, e, head.target_feature(feats[:, :-1].float()), 1)))
            hit = F.linear(f, lm_w).argmax(-1) == label
        for r in range(b):
            out.append(hit[r][valid[r]].tolist())
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--eagle-head", default=None, help="head file (default: the shipped one)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--out", default=str(HERE / "results"))
    args = ap.parse_args(argv)
    import torch
    from slipstream.spec import train as T
    from slipstream.spec.eagle_head import EagleHead
    from slipstream.spec.heads import SHIPPED, SHIPPED_DIR, read_draft_vocab
    from slipstream.spec.train_data import read_prompts
    from slipstream.spec.train_run import make_samples
    path = args.eagle_head or str(SHIPPED_DIR / SHIPPED["eagle"])
    head = EagleHead.load(path, args.device, torch.float32)
    prompts = read_prompts(HERE / "prompts.txt")
    s, _, lm_w, emb_w = make_samples(None, prompts, args.max_tokens, args.device, 0, 16,
                                     lambda *a: None, "eagle3" if head.shape.taps else "final", head)
    w, remap = T.restrict(lm_w, read_draft_vocab(path))
    dev = s.features.device
    runs = depth1_hits(head, emb_w.to(dev).float(), w.to(dev).float(), s,
                       None if remap is None else remap.to(dev))
    n = sum(len(r) for r in runs)
    hits = sum(sum(r) for r in runs)
    after = {True: [0, 0], False: [0, 0]}         # previous hit? -> [hits, positions]
    for r in runs:
        for prev, cur in zip(r, r[1:]):
            after[prev][0] += cur
            after[prev][1] += 1
    rate = {k: v[0] / max(v[1], 1) for k, v in after.items()}
    res = dict(date_utc=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               head=Path(path).name, device=args.device, torch=torch.__version__,
               prompts=len(prompts), max_tokens=args.max_tokens, positions=n,
               depth1_rate=round(hits / n, 4), after_hit=round(rate[True], 4),
               after_miss=round(rate[False], 4),
               positions_after_hit=after[True][1], positions_after_miss=after[False][1])
    print(json.dumps(res), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "acceptance_runs.json").write_text(json.dumps(res, indent=1))
    (out / "acceptance_runs.md").write_text("\n".join([
        f"# EAGLE head: depth-1 hits after a hit and after a miss ({args.device})", "",
        f"{res['date_utc']}, torch {res['torch']}, {res['head']}, the benchmark's {len(prompts)} chat "
        f"prompts, greedy answers of {args.max_tokens} tokens, teacher-forced.", "",
        "| positions | depth-1 top-1 | after a hit | after a miss |", "| ---: | ---: | ---: | ---: |",
        f"| {n} | {res['depth1_rate']:.3f} | {res['after_hit']:.3f} ({after[True][1]}) | "
        f"{res['after_miss']:.3f} ({after[False][1]}) |", ""]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

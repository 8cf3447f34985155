"""Launch configs of the tree-attention kernel for one request's draft tree, the EAGLE
loop's verification on SmolLM2-135M (9 heads, 3 KV heads, head dim 64, 16-token
pages, 61 tree tokens): each config against the engine's rule, 30 layers' caches in
one CUDA graph (a round's 30 calls), every config checked against an fp32 reference.

    python benchmarks/spec/bench_tree_configs.py --out DIR            # H100/H200, ~2 min
    python benchmarks/spec/bench_tree_configs.py --smoke --out DIR    # CPU interpreter

Writes DIR/tree_configs.json, DIR/tree_configs.md and DIR/best.txt (the fastest
configs as `decode_configs.TREE_CONFIG` strings, one a line, for bench_loop variants).
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT)]

HEADS, KV_HEADS, HEAD_DIM, PAGE, NODES, LAYERS = 9, 3, 64, 16, 61, 30
CONTEXTS = (160, 320)
LAUNCHES = [f"{bn}x{w}x{s}" for bn in (32, 64, 128) for w in (2, 4) for s in (2, 3, 4, 6)]
BLOCK_MS = (16, 32)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, two configs, one layer")
    args = ap.parse_args()
    import os
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch
    import torch.nn.functional as F
    import triton
    from benchmarks.cuda_timing import graph_timer
    from slipstream.kernels import decode_configs
    from slipstream.kernels.tree_attention import ancestor_mask, tree_attention
    dev = "cpu" if args.smoke else "cuda"
    dt = torch.float16 if args.smoke else torch.bfloat16   # (the interpreter's bf16 dots are wrong)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    layers = 1 if args.smoke else LAYERS
    contexts = (32,) if args.smoke else CONTEXTS
    launches = LAUNCHES[:2] if args.smoke else LAUNCHES
    block_ms = BLOCK_MS[:1] if args.smoke else BLOCK_MS
    gen = torch.Generator().manual_seed(0)
    parents = [-1] + [int(torch.randint(max(0, i - 8), i, (1,), generator=gen)) for i in range(1, NODES)]
    mask = ancestor_mask(parents)[None].to(dev)
    scale = HEAD_DIM ** -0.5
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
           "torch": torch.__version__, "triton": triton.__version__,
           "shape": dict(heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, page=PAGE, nodes=NODES,
                         layers=layers)}
    rows = []
    for ctx in contexts:
        length = ctx + NODES
        pages = -(-length // PAGE)
        data = []
        for _ in range(layers):
            k = torch.randn(pages * PAGE, KV_HEADS, HEAD_DIM, generator=gen).to(dt)
            v = torch.randn(pages * PAGE, KV_HEADS, HEAD_DIM, generator=gen).to(dt)
            perm = torch.randperm(pages, generator=gen)
            kc = torch.empty(pages, PAGE, KV_HEADS, HEAD_DIM, dtype=dt)
            vc = torch.empty_like(kc)
            kc[perm], vc[perm] = k.view(pages, PAGE, KV_HEADS, HEAD_DIM), v.view(pages, PAGE, KV_HEADS, HEAD_DIM)
            q = torch.randn(NODES, HEADS, HEAD_DIM, generator=gen).to(dt)
            data.append([t.to(dev) for t in (q, kc, vc, perm.view(1, pages).to(torch.int32), k, v)])
        cu = torch.tensor([0, NODES], dtype=torch.int32, device=dev)
        seq = torch.tensor([length], dtype=torch.int32, device=dev)
        outs = [torch.empty_like(d[0]) for d in data]
        q, _, _, _, k, v = data[0]
        full = torch.ones(NODES, length, dtype=torch.bool, device=dev)
        full[:, ctx:length] = mask[0]
        full[:, length:] = False
        ref = F.scaled_dot_product_attention(
            q.float().transpose(0, 1)[None], k[:length].float().transpose(0, 1)[None],
            v[:length].float().transpose(0, 1)[None], attn_mask=full, scale=scale,
            enable_gqa=True)[0].transpose(0, 1)

        def calls():
            return [lambda d=d, o=o: tree_attention(d[0], d[1], d[2], cu, seq, d[3], mask, scale,
                                                    max_query_len=NODES, max_seq_len=512, out=o,
                                                    num_splits=1)
                    for d, o in zip(data, outs)]

        cases = [("rule", 0, "")] + [(f"M{bm}_{lc}", bm, lc) for bm in block_ms for lc in launches]
        for name, bm, lc in cases:
            row = {"context": ctx, "config": name, "block_m": bm, "launch": lc}
            decode_configs.MAX_BLOCK_M, decode_configs.TREE_CONFIG = bm, lc
            try:
                outs[0].fill_(float("nan"))
                calls()[0]()
                err = ((outs[0].double() - ref.double()).norm() / ref.double().norm()).item()
                row["err"] = err
                if not err < 1e-2:
                    raise RuntimeError(f"wrong output: relative error {err}")
                if dev == "cuda":
                    timer = graph_timer(calls(), min_calls=4 * layers)
                    row["us_per_layer"] = round(statistics.median(timer() for _ in range(5)) * 1e3, 3)
            except Exception as e:   # noqa: BLE001 - one config failing must not lose the rest
                row["error"] = f"{type(e).__name__}: {e}"[:200]
            finally:
                decode_configs.MAX_BLOCK_M, decode_configs.TREE_CONFIG = 0, ""
            print(json.dumps(row), flush=True)
            rows.append(row)
    (out_dir / "tree_configs.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    lines = [f"# Tree attention launch configs, {env['device']}, {env['date']}", "",
             f"torch {env['torch']}, triton {env['triton']}; {NODES} tree tokens, {HEADS} heads / "
             f"{KV_HEADS} KV heads, head dim {HEAD_DIM}, {PAGE}-token pages, {layers} layers' caches "
             "in one CUDA graph; us per call (median of 5 timings).", "",
             "| context | config | us | x rule |", "| ---: | --- | ---: | ---: |"]
    best = {}
    for ctx in contexts:
        mine = [r for r in rows if r["context"] == ctx and "us_per_layer" in r]
        rule = next((r["us_per_layer"] for r in mine if r["config"] == "rule"), None)
        for r in sorted(mine, key=lambda r: r["us_per_layer"])[:12]:
            x = f"{rule / r['us_per_layer']:.2f}" if rule else ""
            lines.append(f"| {ctx} | {r['config']} | {r['us_per_layer']:.2f} | {x} |")
            if r["config"] != "rule":
                best.setdefault(r["config"], []).append(r["us_per_layer"] / rule if rule else 1)
    failed = [r for r in rows if "error" in r]
    lines += ["", f"{len(failed)} configs failed or were wrong" + (
        ": " + "; ".join(f"{r['config']} ({r['error'][:60]})" for r in failed[:6]) if failed else ".")]
    (out_dir / "tree_configs.md").write_text("\n".join(lines) + "\n")
    ranked = sorted((statistics.mean(v), k) for k, v in best.items() if len(v) == len(contexts))
    (out_dir / "best.txt").write_text("".join(f"{k}\n" for _, k in ranked[:3]))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

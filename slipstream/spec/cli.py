"""`slipstream train-draft`: train Medusa / EAGLE heads for a target model."""
from __future__ import annotations

import argparse

from slipstream.commands.options import number


def add_parser(sub) -> None:
    p = sub.add_parser("train-draft", help="train Medusa or EAGLE draft heads on the "
                       "target's own answers (GPU if there is one, else CPU)")
    p.add_argument("--method", nargs="+", default=["medusa", "eagle"],
                   choices=["medusa", "eagle", "peagle"],
                   help="which heads to train (peagle: an EAGLE head with placeholders for "
                        "parallel drafting)")
    p.add_argument("--init-head", default=None,
                   help="start the EAGLE / peagle head from this head file (same shape; its "
                        "draft vocabulary is kept)")
    p.add_argument("--init-lr-scale", type=float, default=0.0,
                   help="peagle from --init-head: the layer's learning rate as a fraction of "
                        "--lr (0: only the placeholders train)")
    p.add_argument("--feature-layers", default="eagle3",
                   help="what an EAGLE head reads of the target: eagle3 (a low, a middle and a "
                        "high layer, fused, as EAGLE-3), final (the final hidden state, "
                        "EAGLE-1/2) or layer indices like 2,15,27 (a head from --init-head "
                        "keeps its own)")
    p.add_argument("--model", default=None, help="target model (default: SmolLM2-135M-Instruct)")
    p.add_argument("--prompts", default=None,
                   help="prompt file, one per line (default: the shipped training prompts)")
    p.add_argument("--num-prompts", type=int, default=None, help="use only the first N prompts")
    p.add_argument("--max-tokens", type=int, default=160, help="answer length per prompt")
    p.add_argument("--branches", type=int, default=0,
                   help="per answer, this many more sequences: at a random point of the "
                        "answer's first half the target's second choice replaces its first "
                        "and the target answers on greedily (more varied contexts)")
    p.add_argument("--branch-tokens", type=int, default=None,
                   help="answer length of a branch (default: half of --max-tokens)")
    p.add_argument("--epochs", type=int, default=6, help="EAGLE epochs")
    p.add_argument("--medusa-epochs", type=int, default=None, help="default: half of --epochs")
    p.add_argument("--ttt-steps", type=int, default=3,
                   help="EAGLE training-time-test passes (drafting depths trained)")
    p.add_argument("--batch-tokens", type=int, default=16384, help="EAGLE tokens per batch")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--draft-vocab", type=int, default=16384,
                   help="draft only the N tokens most frequent in the answers (0: all)")
    p.add_argument("--max-num-seqs", type=int, default=256,
                   help="requests the engine answers at once")
    p.add_argument("--device", default="auto", help="auto | cuda | cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-cache", default=None,
                   help="keep the target's answers and features in this file and reuse them")
    p.add_argument("--out", default="draft-heads",
                   help="directory for <model>.<method>.safetensors and <model>.train.json "
                        "(default: ./draft-heads; the shipped heads live in "
                        "slipstream/spec/weights/)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from slipstream.spec.train_run import train_draft
    if args.max_tokens < 2 or args.epochs < 1 or args.ttt_steps < 1:
        raise ValueError("--max-tokens must be >= 2, --epochs and --ttt-steps >= 1")
    if args.draft_vocab < 0:
        raise ValueError("--draft-vocab must be >= 0")
    if args.branches < 0:
        raise ValueError("--branches must be >= 0")
    branch_tokens = args.branch_tokens if args.branch_tokens is not None else args.max_tokens // 2
    if args.branches and branch_tokens < 2:
        raise ValueError("--branch-tokens must be >= 2")
    if args.num_prompts is not None and args.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    train_draft(args.method, args.model, args.out, args.prompts, args.max_tokens, args.epochs,
                args.seed, data_cache=args.data_cache, device=args.device,
                num_prompts=args.num_prompts, medusa_epochs=args.medusa_epochs,
                ttt_steps=args.ttt_steps, batch_tokens=args.batch_tokens, lr=args.lr,
                max_num_seqs=args.max_num_seqs, draft_vocab=args.draft_vocab,
                init_head=args.init_head, init_lr_scale=args.init_lr_scale,
                feature_layers=args.feature_layers, branches=args.branches,
                branch_tokens=branch_tokens if args.branches else 0)
    return 0


def add_spec_options(p: argparse.ArgumentParser) -> None:
    """The speculative-decoding engine options, for generate / chat / serve / bench."""
    g = p.add_argument_group("speculative decoding")
    g.add_argument("--speculative-method", default=None,
                   choices=["draft", "ngram", "medusa", "eagle", "peagle"],
                   help="draft tokens with a draft model, prompt lookup, Medusa heads, an EAGLE "
                        "head (a dynamic tree) or an EAGLE head drafting all tokens in one pass "
                        "(peagle)")
    g.add_argument("--speculative-model", default=None,
                   help="the draft model (draft) or head file (medusa, eagle, peagle; default: "
                        "the heads shipped for the default model)")
    g.add_argument("--num-speculative-tokens", type=number(int, 1, 16), default=None,
                   help="draft length (EAGLE: tree depth), 1 to 16; default 4")
    g.add_argument("--speculative-draft-layers", type=number(int, 1, None), default=None,
                   help="draft with the first N layers of --speculative-model (early exit)")
    g.add_argument("--spec-tree", default=None,
                   help="tree shape: medusa top-k per head ('3,2,1'), eagle 'topk,beam,nodes'")
    g.add_argument("--no-spec-auto-off", action="store_true",
                   help="speculate even where the roofline model predicts no gain")
    g.add_argument("--spec-draft-graphs", action="store_true",
                   help="EAGLE: replay the tree expansion from a CUDA graph (GPU)")
    g.add_argument("--spec-online", action="store_true",
                   help="EAGLE / P-EAGLE: keep training the head on the target's outputs while "
                        "serving (online adaptation)")
    g.add_argument("--spec-draft-min-prob", type=number(float, 0, 1), default=0.0,
                   help="EAGLE: leave unverified the drafts whose path the head gives less than "
                        "this probability (a chain stops there); 0 (default): off")
    g.add_argument("--spec-device-loop", action="store_true",
                   help="EAGLE: answer single greedy prompts with every round on the device "
                        "(on a CPU with --spec-tree 1,1,N: a chain, each round a few C calls)")
    g.add_argument("--spec-compile", action="store_true",
                   help="with --spec-device-loop: compile the tree expansion and the round's "
                        "small ops (torch.compile; adds a compile of ~20-60 s at the first prompt)")


# EngineArgs field -> the flag that sets it (`speculative_auto_off` is --no-spec-auto-off, negated)
SPEC_FLAGS = {"speculative_method": "--speculative-method", "speculative_model": "--speculative-model",
              "num_speculative_tokens": "--num-speculative-tokens",
              "speculative_draft_layers": "--speculative-draft-layers", "speculative_tree": "--spec-tree",
              "speculative_draft_graphs": "--spec-draft-graphs",
              "speculative_device_loop": "--spec-device-loop", "speculative_compile": "--spec-compile",
              "speculative_online": "--spec-online",
              "speculative_draft_min_prob": "--spec-draft-min-prob"}


def spec_engine_args(args: argparse.Namespace) -> dict:
    """The EngineArgs fields of the flags above (a command without a flag: its default)."""
    out = {field: getattr(args, flag[2:].replace("-", "_"), False)
           for field, flag in SPEC_FLAGS.items()}
    out["speculative_auto_off"] = not args.no_spec_auto_off
    return out


def add_bench_parser(bench_subparsers) -> None:
    """`slipstream bench spec`."""
    from slipstream.spec import bench
    p = bench_subparsers.add_parser("spec", help="speculative decoding: tau, acceptance and "
                                    "speedup over plain decoding per method",
                                    description=bench.__doc__.split("\n\n")[0])
    bench.add_arguments(p)
    p.set_defaults(func=bench.run)

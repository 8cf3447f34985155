"""Speculative decoding on the default model (the script form of
`slipstream bench spec`): tau, acceptance per position and wall-clock speedup
over plain decoding, the two alternating prompt by prompt in one process.

    python benchmarks/spec/bench_spec.py --device cpu --num-prompts 4 --max-tokens 48
    python benchmarks/spec/bench_spec.py --device cuda --batch 1 64 --max-tokens 128   # H200
    python benchmarks/spec/bench_spec.py --smoke                # tiny random model, seconds

Writes results_<device>.{json,md} (smoke.{json,md} for --smoke) to --out
(default benchmarks/spec/results). Outputs are checked token for token
against plain decoding (`identical`; in bf16 a near-tie may flip, since
batched verification and one-token decoding round differently).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))


def _tiny_model(folder: Path) -> tuple[str, dict]:
    """A tiny random Llama (and its Medusa / EAGLE heads) for --smoke."""
    import torch
    from tests.engine.conftest import build_hf_model
    from tests.loader.checkpoints import write_hf_tokenizer
    from slipstream.loader import open_model
    from slipstream.spec.eagle import EagleHead, EagleShape
    from slipstream.spec.medusa import MedusaHeads
    folder.mkdir(parents=True, exist_ok=True)
    build_hf_model("llama").save_pretrained(folder)
    write_hf_tokenizer(folder)
    c = open_model(str(folder)).config
    torch.manual_seed(0)
    heads = folder.parent / "heads"     # not inside the model folder: its loader reads every file
    heads.mkdir(exist_ok=True)
    MedusaHeads(c.hidden_size, 3).save(heads / "medusa.safetensors")
    EagleHead(EagleShape(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                         64, c.rope_theta, c.max_position_embeddings)).save(heads / "eagle.safetensors")
    return str(folder), {"medusa": str(heads / "medusa.safetensors"),
                         "eagle": str(heads / "eagle.safetensors"), "draft": str(folder)}


def main(argv=None) -> int:
    from slipstream.spec import bench
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_arguments(ap)
    ap.add_argument("--smoke", action="store_true", help="tiny random model, few tokens")
    ap.set_defaults(out=str(HERE / "results"))
    args = ap.parse_args(argv)
    if args.smoke:
        import tempfile
        model, heads = _tiny_model(Path(tempfile.mkdtemp()) / "smoke-model")
        args.max_tokens, args.num_prompts = min(args.max_tokens, 12), args.num_prompts or 3
        return bench.run(args, model, heads, stem="smoke")
    return bench.run(args)


if __name__ == "__main__":
    sys.exit(main())

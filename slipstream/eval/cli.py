"""`slipstream eval ppl [MODEL] --text FILE [--context 1024] [--stride N]`."""
from __future__ import annotations

import json

from slipstream.commands.options import DTYPES


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("eval", help="evaluate a model (perplexity)")
    sub = p.add_subparsers(dest="eval_command", required=True)
    q = sub.add_parser("ppl", help="perplexity on a text file (sliding window)")
    q.add_argument("model", nargs="?", default=None,
                   help="a Hugging Face folder, a quantized checkpoint or a .gguf file "
                        "(default: SmolLM2-135M-Instruct)")
    q.add_argument("--text", required=True, help="UTF-8 text file")
    q.add_argument("--context", type=int, default=1024, help="tokens per window (default 1024)")
    q.add_argument("--stride", type=int, default=None,
                   help="tokens between window starts; each window scores its last STRIDE "
                        "tokens (default context / 2)")
    q.add_argument("--quantization", default="auto",
                   help="auto (default): the model as `generate` runs it (a GGUF file's blocks "
                        "through the CPU kernels); none: dequantized, dense; or a scheme that "
                        "quantizes a float checkpoint at load")
    q.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "int8", "fp8", "fp8_e4m3", "kivi4", "kivi2"),
                   help="KV cache format (int8 / fp8: 1-byte codes, a scale per token and head; "
                        "kivi4 / kivi2: KIVI codes)")
    q.add_argument("--dtype", default="auto", choices=DTYPES, metavar="DTYPE",
                   help="weights' dtype: auto (default), float32, float16, bfloat16")
    q.add_argument("--device", default="auto")
    q.add_argument("--json", action="store_true", help="print the result as JSON")
    q.set_defaults(func=run)


def run(args) -> int:
    from pathlib import Path

    from slipstream import LLM
    from slipstream.eval.perplexity import check_windows, perplexity
    path = Path(args.text)
    if not path.is_file():
        raise ValueError(f"text: no such file {args.text!r}")
    check_windows(args.context, args.stride, ("--context", "--stride"))   # before the model loads
    llm = LLM(args.model, dtype=args.dtype, device=args.device,
              quantization=args.quantization, max_model_len=args.context + 1,
              kv_cache_dtype=args.kv_cache_dtype,
              enable_prefix_caching=False)
    ids = llm.engine.tokenizer.encode(path.read_text(encoding="utf-8"))
    if len(ids) < 2:
        raise ValueError("text: fewer than 2 tokens")
    r = perplexity(llm, ids, args.context, args.stride)
    if args.json:
        print(json.dumps(vars(r)))
    else:
        print(f"perplexity {r.ppl:.4f} over {r.tokens} tokens ({r.windows} windows of up to "
              f"{r.context} tokens, stride {r.stride}; each window scores the tokens no "
              f"earlier window scored)")
    return 0

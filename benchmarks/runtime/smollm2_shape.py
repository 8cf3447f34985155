"""A SmolLM2-135M-shaped model folder (config and a stand-in tokenizer, no weights), for
`--load-format dummy` runs of the default model's shape where its GGUF file is not at hand.

    python benchmarks/runtime/smollm2_shape.py DIR
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

CONFIG = {  # SmolLM2-135M-Instruct's config.json, the fields the loader reads
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
    "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
    "num_key_value_heads": 3, "head_dim": 64, "hidden_act": "silu", "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0, "max_position_embeddings": 8192, "vocab_size": 49152,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
}


def main() -> None:
    from tests.loader.checkpoints import write_hf_tokenizer
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(CONFIG, indent=1))
    write_hf_tokenizer(out)
    print(out)


if __name__ == "__main__":
    main()

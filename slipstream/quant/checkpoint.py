"""Quantized checkpoints: a Hugging Face-style folder that slipstream loads back.

    config.json        the model's config plus "quantization_config":
                       {"quant_method": "slipstream", "format_version": 1, "method": "gptq",
                        "layers": {"model.layers.0.self_attn.qkv_proj": {"kind": "int", "bits": 4,
                                   "group_size": 128, "sym": false, "act_order": false}, ...}}
    model.safetensors  unfused Hugging Face names: q_proj.qweight, q_proj.scales, ...
    tokenizer.json, tokenizer_config.json (+ generation_config.json when the source has one)

Per-layer "kind": "int" (weight-only, IntWeightMethod tensors qweight/scales/qzeros/perm),
"w8a8" (Int8W8A8Method: weight int8 + weight_scale), or "dense". Layers are named as
QuantMethodFor sees them (fused qkv_proj / gate_up_proj: q, k and v share one plan).
Only safetensors are written; nothing is pickled.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from slipstream.quant.base import register_scheme

FORMAT_VERSION = 1
_UNFUSE = {".qkv_proj.": (".q_proj.", ".k_proj.", ".v_proj."),
           ".gate_up_proj.": (".gate_proj.", ".up_proj.")}
_ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
         "qwen2": "Qwen2ForCausalLM"}


def method_for_plan(plan: dict | None):
    """The prequantized QuantMethod of one layer's plan entry (None: dense)."""
    if plan is None or plan.get("kind") == "dense":
        return None
    kind = plan.get("kind")
    if kind == "int":
        from slipstream.quant.int_weight import IntWeightMethod
        return IntWeightMethod(int(plan["bits"]), plan.get("group_size"), bool(plan["sym"]),
                               bool(plan.get("act_order", False)), prequantized=True)
    if kind == "w8a8":
        from slipstream.quant.w8a8 import Int8W8A8Method
        return Int8W8A8Method(prequantized=True)
    raise ValueError(f"quantization_config: unknown layer kind {kind!r}")


@register_scheme("slipstream")
def _slipstream(config, files):
    qc = getattr(files, "quantization_config", None)
    if not qc or qc.get("quant_method") != "slipstream":
        raise ValueError("quantization: 'slipstream' loads checkpoints written by "
                         "`slipstream quantize`; this model has no such quantization_config")
    if qc.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"quantization_config: format_version {qc.get('format_version')!r} "
                         f"is not {FORMAT_VERSION}")
    layers = qc.get("layers", {})

    def pick(prefix: str):
        return method_for_plan(layers.get(prefix))
    return pick


def hf_config_dict(mc) -> dict:
    """A config.json for a model opened from GGUF (HF folders keep their own)."""
    d = {"architectures": [_ARCH[mc.architecture]], "model_type": mc.architecture,
         "vocab_size": mc.vocab_size, "hidden_size": mc.hidden_size,
         "intermediate_size": mc.intermediate_size, "num_hidden_layers": mc.num_hidden_layers,
         "num_attention_heads": mc.num_attention_heads,
         "num_key_value_heads": mc.num_key_value_heads, "head_dim": mc.head_dim,
         "max_position_embeddings": mc.max_position_embeddings, "rms_norm_eps": mc.rms_norm_eps,
         "rope_theta": mc.rope_theta, "tie_word_embeddings": mc.tie_word_embeddings,
         "attention_bias": mc.attention_bias, "hidden_act": mc.hidden_act,
         "bos_token_id": mc.bos_token_id,
         "eos_token_id": list(mc.eos_token_ids) if len(mc.eos_token_ids) != 1
         else mc.eos_token_ids[0]}
    if mc.sliding_window is not None:
        d["sliding_window"] = mc.sliding_window
    if mc.rope_scaling is not None:
        r = mc.rope_scaling
        d["rope_scaling"] = {"rope_type": r.rope_type, "factor": r.factor,
                             "low_freq_factor": r.low_freq_factor,
                             "high_freq_factor": r.high_freq_factor,
                             "original_max_position_embeddings": r.original_max_position_embeddings}
    return d


def checkpoint_tensors(model) -> dict[str, torch.Tensor]:
    """Our model's parameters under unfused Hugging Face names (fused shards split along
    their output_dim; parameters without one, like perm, repeated for every shard)."""
    out: dict[str, torch.Tensor] = {}
    modules = dict(model.named_modules())
    for name, p in model.named_parameters():
        if name == "lm_head.weight" and model.lm_head.tied:
            continue
        fused = next((f for f in _UNFUSE if f in name), None)
        if fused is None:
            out[name] = p.data
            continue
        module = modules[name.rsplit(".", 1)[0]]
        dim = getattr(p, "output_dim", None)
        offset = 0
        for shard_name, size in zip(_UNFUSE[fused], module.output_sizes):
            key = name.replace(fused, shard_name)
            out[key] = p.data.clone() if dim is None else p.data.narrow(dim, offset, size)
            offset += size
    return {k: v.detach().cpu().contiguous() for k, v in out.items()}


def save_quantized(model, files, out_dir: str | Path, layers: dict, method: str,
                   extra: dict | None = None) -> Path:
    """Write the quantized `model` (loaded from `files`) as a slipstream checkpoint."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    src = Path(files.path)
    if src.is_dir():
        config = json.loads((src / "config.json").read_text(encoding="utf-8"))
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                     "special_tokens_map.json", "chat_template.jinja", "chat_template.json"):
            if (src / name).is_file():
                shutil.copy(src / name, out / name)
    else:
        config = hf_config_dict(files.config)
        _write_tokenizer(files.tokenizer(), out)
    config["quantization_config"] = {"quant_method": "slipstream",
                                     "format_version": FORMAT_VERSION, "method": method,
                                     **(extra or {}), "layers": layers}
    (out / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    save_file(checkpoint_tensors(model), str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out


def _write_tokenizer(tok, out: Path) -> None:
    tok.backend.save(str(out / "tokenizer.json"))
    special = tok._special_strings
    cfg = {"add_bos_token": tok.add_bos, "add_eos_token": tok.add_eos,
           "bos_token": special.get("bos_token"), "eos_token": special.get("eos_token")}
    if tok.chat_template:
        cfg["chat_template"] = tok.chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2), encoding="utf-8")
    if len(tok.eos_token_ids) > 1:
        (out / "generation_config.json").write_text(
            json.dumps({"eos_token_id": list(tok.eos_token_ids)}), encoding="utf-8")

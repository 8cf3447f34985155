"""GPTQ (GPTQModel/AutoGPTQ) and AWQ (AutoAWQ gemm) checkpoints: written here by an
independent packer from the formats' definitions, loaded by LLM, and scored like a
dense model holding the same dequantized weights."""
import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from slipstream.quant.primitives import quantize
from tests.quant.conftest import make_llm, prompt_logprobs, random_prompts

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def pack_gptq(codes_kn: np.ndarray, zeros_gn: np.ndarray):
    """codes [K, N], zeros [G, N] (4-bit) -> qweight [K/8, N], qzeros [G, N/8] int32 (v1)."""
    k, n = codes_kn.shape
    qweight = np.zeros((k // 8, n), dtype=np.uint32)
    for i in range(8):
        qweight |= codes_kn[i::8].astype(np.uint32) << (4 * i)
    zm1 = (zeros_gn.astype(np.int64) - 1) & 0xF
    qzeros = np.zeros((zeros_gn.shape[0], n // 8), dtype=np.uint32)
    for i in range(8):
        qzeros |= zm1[:, i::8].astype(np.uint32) << (4 * i)
    return torch.from_numpy(qweight.view(np.int32)), torch.from_numpy(qzeros.view(np.int32))


def pack_awq(vals_rn: np.ndarray) -> torch.Tensor:
    """[R, N] 4-bit -> [R, N/8] int32, slot i of word j holding column 8j + AWQ_ORDER[i]."""
    r, n = vals_rn.shape
    out = np.zeros((r, n // 8), dtype=np.uint32)
    for i, o in enumerate(AWQ_ORDER):
        out |= vals_rn[:, o::8].astype(np.uint32) << (4 * i)
    return torch.from_numpy(out.view(np.int32))


def write(src, dst, fmt, group=64, act_order=False):
    shutil.copytree(src, dst)
    sd = load_file(str(src / "model.safetensors"))
    fake, out = dict(sd), {}
    g = torch.Generator().manual_seed(5)
    perms = {}
    for name, w in sd.items():
        if not any(p in name for p in PROJ) or not name.endswith(".weight"):   # biases stay
            out[name] = w
            continue
        base = name[:-len(".weight")]
        w = w.float()
        k = w.shape[1]
        # One act-order per input: q/k/v (and gate/up) share theirs, as GPTQ makes them.
        key = (name.split(".mlp.")[0] + ".mlp" + str(k)) if ".mlp." in name else \
            name.split(".o_proj")[0] if "o_proj" in name else name.split(".self_attn.")[0]
        if key not in perms:
            perms[key] = torch.randperm(k, generator=g) if act_order else torch.arange(k)
        perm = perms[key]
        qt = quantize(w[:, perm], 4, False, "group", group)      # groups in permuted order
        scale16 = qt.scale.half()
        deq_p = (qt.codes.float() - qt.zero.repeat_interleave(group, 1)) * \
            scale16.float().repeat_interleave(group, 1)
        deq = torch.empty_like(deq_p)
        deq[:, perm] = deq_p
        fake[name] = deq
        pos = torch.empty(k, dtype=torch.long)
        pos[perm] = torch.arange(k)                                # input k sits at pos[k]
        codes_kn = qt.codes[:, pos].t().numpy()                    # [K, N] in input order
        zeros_gn = qt.zero.t().to(torch.uint8).numpy()
        if fmt == "gptq":
            qw, qz = pack_gptq(codes_kn, zeros_gn)
            out[f"{base}.g_idx"] = (pos // group).to(torch.int32)
        else:
            qw, qz = pack_awq(codes_kn), pack_awq(zeros_gn)
        out[f"{base}.qweight"], out[f"{base}.qzeros"] = qw, qz
        out[f"{base}.scales"] = scale16.t().contiguous()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = (
        {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act_order,
         "sym": False, "checkpoint_format": "gptq"} if fmt == "gptq" else
        {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
         "version": "gemm"})
    (dst / "config.json").write_text(json.dumps(cfg))
    return fake


@pytest.mark.parametrize("fmt,act_order", [("gptq", False), ("gptq", True), ("awq", False)])
def test_hf_quantized_checkpoint_scores_like_its_dequantized_weights(tiny_llama, tmp_path,
                                                                     fmt, act_order, monkeypatch):
    monkeypatch.setenv("SLIPSTREAM_CPU_BLOCKS", "0")    # exact products (no int8 activations)
    fake = write(tiny_llama, tmp_path / "q", fmt, act_order=act_order)
    dense_dir = tmp_path / "fake"
    shutil.copytree(tiny_llama, dense_dir)
    save_file({k: v.contiguous() for k, v in fake.items()}, str(dense_dir / "model.safetensors"),
              metadata={"format": "pt"})
    expect = prompt_logprobs(make_llm(dense_dir), random_prompts())
    llm = make_llm(tmp_path / "q")
    got = prompt_logprobs(llm, random_prompts())
    torch.testing.assert_close(got, expect, atol=2e-4, rtol=0)
    qkv = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert hasattr(qkv, "perm") == act_order
    # With the CPU's GGUF-block products (the default): the same checkpoint runs on them,
    # an act-order layer through its permutation, outside the one-call decode step.
    monkeypatch.delenv("SLIPSTREAM_CPU_BLOCKS")
    blocks = make_llm(tmp_path / "q")
    qkv = blocks.engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert hasattr(qkv, "cpu_blocks") and hasattr(qkv, "gguf_weight") != act_order
    assert (prompt_logprobs(blocks, random_prompts()) - got).abs().mean() < 0.05

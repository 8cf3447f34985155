"""User-facing engine options (shared by `LLM` and the CLI) -> EngineConfig."""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from slipstream.config import (CacheConfig, EngineConfig, ModelConfig, ParallelConfig,
                               SchedulerConfig, SpecConfig, resolve_device, resolve_dtype)


# Quantization schemes that shard for tensor parallelism: a float checkpoint quantized
# at load (each rank quantizes its own shard), or a checkpoint of `slipstream quantize`.
TP_QUANTIZATION = ("fp8", "int8", "rtn-int4", "rtn-int3", "w8a8", "slipstream", "gptq", "awq",
                   "gguf")


@dataclass
class EngineArgs:
    model: str | None = None
    dtype: str | torch.dtype = "auto"
    device: str | None = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None      # bytes for the KV pool on the CPU
    gpu_memory_utilization: float = 0.90
    # auto (the model dtype), int8 or fp8 (= fp8_e4m3): codes + a scale per token and head
    kv_cache_dtype: str = "auto"
    attention_backend: str | None = None
    # a scheme of quant/; "auto": GGUF blocks kept at run time on a CPU (quant/gguf.py);
    # "none" or None: dense weights
    quantization: str | None = "auto"
    enforce_eager: bool = False
    async_scheduling: bool | None = None
    # Speculative decoding (vLLM's names): method draft | ngram | medusa | eagle | peagle.
    speculative_method: str | None = None
    speculative_model: str | None = None
    num_speculative_tokens: int | None = None
    speculative_draft_layers: int | None = None
    speculative_tree: str | None = None      # medusa: "3,2,1" top-k per head; eagle: "topk,beam,nodes"
    speculative_auto_off: bool = True
    # EAGLE's tree expansion replayed from a CUDA graph (opt-in until measured on a GPU)
    speculative_draft_graphs: bool = False
    # EAGLE: one greedy prompt of LLM.generate, every round on the device (spec/loop_path.py;
    # on a CPU a chain, speculative_tree with top-k 1, takes spec/cpu_loop.py)
    speculative_device_loop: bool = False
    # The device loop's tree expansion and round parts through torch.compile (fuses their
    # small ops; a compile of ~20-60 s when the first loop is built)
    speculative_compile: bool = False
    # EAGLE / P-EAGLE: keep training the head on the pairs it drafts from (spec/online.py)
    speculative_online: bool = False
    # EAGLE: drafts whose path the head gives less than this probability are not verified
    # (a chain stops there; the engine's trees keep at least their best node); 0: off
    speculative_draft_min_prob: float = 0.0
    seed: int = 0
    load_format: str = "auto"                # "auto": the model's weights; "dummy": random
    tensor_parallel_size: int = 1            # ranks sharing each layer (distributed/)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    def create_config(self, model_path: str, mc: ModelConfig) -> EngineConfig:
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format: expected 'auto' or 'dummy', got {self.load_format!r}")
        device = resolve_device(self.device)
        dtype = resolve_dtype(self.dtype, device)
        quantization = None if self.quantization == "none" else self.quantization
        if quantization in ("auto", "gguf"):   # GGUF blocks at run time on a CPU (quant/gguf.py)
            from slipstream.quant.gguf import runs_quantized
            # Dummy weights are dense.
            real = self.load_format == "auto"
            blocks = real and runs_quantized(self.model, device)
            if quantization == "auto":
                quantization = "gguf" if blocks else None
            if blocks and self.dtype in (None, "auto"):
                dtype = torch.float32   # the kernels take fp32 activations; weights stay in blocks
        if self.dtype in (None, "auto"):
            from slipstream.quant.cpu_blocks import runs_on_blocks
            if runs_on_blocks(model_path, quantization, device):
                dtype = torch.float32   # weight-only codes as blocks for the same kernels
        max_len = self.max_model_len or mc.max_position_embeddings
        if max_len < 2:
            raise ValueError("max_model_len must be at least 2")
        if max_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len={max_len} exceeds the model's context of "
                             f"{mc.max_position_embeddings} tokens")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError("block_size must be a power of two")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1")
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = 2048 if self.enable_chunked_prefill else max(2048, max_len)
        if budget < 1:
            raise ValueError("max_num_batched_tokens must be at least 1")
        if not self.enable_chunked_prefill and budget < max_len:
            raise ValueError("without chunked prefill, max_num_batched_tokens must be at least "
                             f"max_model_len ({max_len})")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        from slipstream.quant.kv_quant import kv_format
        kv_fmt = kv_format(self.kv_cache_dtype)
        if kv_fmt.kivi_bits and self.speculative_method is not None:
            # Rejected drafts would be sealed into a block's codes before they are rewritten.
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r}: speculative decoding runs "
                             "with a 16-bit, int8 or fp8 KV cache (not KIVI)")
        backend = self.attention_backend
        if kv_fmt.kivi_bits and backend not in (None, "torch", "triton"):
            raise ValueError(f"kv_cache_dtype={kv_fmt.name!r} runs on the torch or triton "
                             f"attention backend, not {backend!r}")
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be an integer of at least 1, got {tp!r}")
        if tp > 1:
            from slipstream.distributed.parallel import check_shardable
            check_shardable(mc, tp)
            if quantization is not None and quantization not in TP_QUANTIZATION:
                raise ValueError(f"tensor_parallel_size={tp}: quantization={quantization!r} is "
                                 f"not sharded yet; these shard: {', '.join(TP_QUANTIZATION)}")
        return EngineConfig(
            model=model_path,
            model_config=mc,
            dtype=dtype,
            device=device,
            cache=CacheConfig(block_size=self.block_size,
                              gpu_memory_utilization=self.gpu_memory_utilization,
                              cpu_kv_cache_bytes=self.kv_cache_memory,
                              num_blocks=self.num_kv_blocks,
                              enable_prefix_caching=self.enable_prefix_caching,
                              kv_cache_dtype=kv_fmt.name),
            scheduler=SchedulerConfig(max_num_seqs=self.max_num_seqs,
                                      max_num_batched_tokens=budget,
                                      max_model_len=max_len,
                                      enable_chunked_prefill=self.enable_chunked_prefill),
            parallel=ParallelConfig(tensor_parallel_size=tp),
            attention_backend=backend,
            quantization=quantization,
            enforce_eager=self.enforce_eager,
            async_scheduling=self.async_scheduling,
            speculative=self.spec_config(),
            seed=self.seed,
        )

    def spec_config(self) -> SpecConfig:
        method = self.speculative_method
        if method is None:
            # `is not`: 0 is a value given (num_speculative_tokens=0), not an unset flag
            given = [name for name in ("speculative_model", "num_speculative_tokens",
                                       "speculative_draft_layers", "speculative_tree",
                                       "speculative_draft_graphs", "speculative_device_loop",
                                       "speculative_compile", "speculative_online")
                     if getattr(self, name) is not None and getattr(self, name) is not False]
            given += ["speculative_draft_min_prob"] if self.speculative_draft_min_prob else []
            if given:
                raise ValueError(f"{', '.join(given)} need{'s' if len(given) == 1 else ''} "
                                 "speculative_method")
            return SpecConfig()
        methods = ("draft", "ngram", "medusa", "eagle", "peagle")
        if method not in methods:
            raise ValueError(f"speculative_method: unknown {method!r}; choose from "
                             f"{', '.join(methods)}")
        k = 4 if self.num_speculative_tokens is None else self.num_speculative_tokens
        if not 1 <= k <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16], got {k}")
        if self.speculative_draft_layers is not None and method != "draft":
            raise ValueError("speculative_draft_layers applies to speculative_method='draft'")
        if self.speculative_draft_graphs and method != "eagle":
            raise ValueError("speculative_draft_graphs applies to speculative_method='eagle'")
        if self.speculative_device_loop and method != "eagle":
            raise ValueError("speculative_device_loop applies to speculative_method='eagle'")
        if self.speculative_compile and not self.speculative_device_loop:
            raise ValueError("speculative_compile applies to the EAGLE device loop "
                             "(speculative_device_loop=True)")
        p = self.speculative_draft_min_prob
        if not (isinstance(p, (int, float)) and 0 <= p < 1):
            raise ValueError(f"speculative_draft_min_prob must be in [0, 1), got {p!r}")
        if p and method != "eagle":
            raise ValueError("speculative_draft_min_prob applies to speculative_method='eagle'")
        if self.speculative_online and method not in ("eagle", "peagle"):
            raise ValueError("speculative_online applies to speculative_method 'eagle' or 'peagle'")
        extra = {}
        if self.speculative_tree:
            try:
                nums = tuple(int(x) for x in self.speculative_tree.split(","))
            except ValueError:
                nums = ()
            if method == "medusa" and nums and min(nums) >= 1:
                extra = dict(medusa_topk=nums)
            elif method == "eagle" and len(nums) == 3 and min(nums) >= 1:
                extra = dict(eagle_topk=nums[0], eagle_beam=nums[1], eagle_max_nodes=nums[2])
            else:
                raise ValueError(f"speculative_tree {self.speculative_tree!r}: medusa takes top-k "
                                 "per head ('3,2,1'), eagle 'topk,beam,max_nodes' ('4,4,16')")
        cfg_nodes = _tree_nodes(method, extra)
        if cfg_nodes > 63:
            raise ValueError(f"speculative_tree: {cfg_nodes} draft nodes; the tree-attention "
                             "kernel verifies at most 63 (64 rows with the root)")
        draft_model = self.speculative_model
        if draft_model is None and method in ("medusa", "eagle", "peagle") \
                and not is_default_model(self.model):
            # The shipped heads read SmolLM2-135M's hidden states: on another model they
            # fail deep inside (an IndexError, a feature-tap error) or draft nonsense.
            raise ValueError(f"speculative_method={method!r}: no shipped {method} heads for "
                             f"the model {self.model!r} (they are trained for the default "
                             f"model, SmolLM2-135M-Instruct); pass speculative_model=PATH, a "
                             f"head file from `slipstream train-draft --method {method}`")
        if method == "draft" and draft_model is None:
            if self.speculative_draft_layers is None:
                # The whole target drafting for itself: every draft costs a target step.
                raise ValueError("speculative_method='draft' needs speculative_model (a smaller "
                                 "model with the target's tokenizer) or speculative_draft_layers="
                                 "N (the target's own first N layers draft)")
            draft_model = self.model     # early exit: the target's first layers (None: default)
        return SpecConfig(method=method, num_speculative_tokens=k, model=draft_model,
                          draft_num_layers=self.speculative_draft_layers,
                          auto_off=self.speculative_auto_off,
                          draft_graphs=self.speculative_draft_graphs,
                          device_loop=self.speculative_device_loop,
                          loop_compile=self.speculative_compile,
                          online=self.speculative_online, draft_min_prob=float(p), **extra)


def is_default_model(model: str | None) -> bool:
    """Whether `model` names the default model (None, or its GGUF file)."""
    if model is None:
        return True
    from pathlib import Path

    from slipstream.errors import ModelLoadError
    from slipstream.loader import DEFAULT_MODEL_FILE, default_model_path
    path = Path(model).expanduser()
    if path.name == DEFAULT_MODEL_FILE:
        return True
    try:
        return path.resolve() == default_model_path().resolve()
    except ModelLoadError:      # the default model is not installed
        return False


def _tree_nodes(method: str, extra: dict) -> int:
    if method == "medusa":
        nodes, width = 0, 1
        from slipstream.spec.medusa import default_topk
        for k in extra.get("medusa_topk") or default_topk(4):   # the default over 4 heads
            width *= k
            nodes += width
        return nodes
    if method == "eagle":
        return extra.get("eagle_max_nodes", SpecConfig.eagle_max_nodes)
    return 0

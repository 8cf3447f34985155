"""A whole decode step of a Llama-family model in one C call (launcher for `cpu_decoder.c`).

On the CPU a batch-1 decode step of a small model is mostly Python: ~10 torch
ops and kernel calls per layer, each a few microseconds of interpreter and
dispatcher time, add up to as much as the products themselves. `CPUDecoder`
describes the model to the C code once (pointers to the GGUF blocks, norms,
rotary tables, KV caches, in ctypes structures), and a decode step is then
one call: every layer's norm, q/k/v product, rotary, KV store, attention over
the paged cache, output product, norm, gate/up product, SiLU * up and down
product, and the final norm.

A draft-verification step (a sequence bringing its last token plus up to
MAX_QUERY - 1 drafts, a chain or a tree under `batch.tree_mask`) is one call
too (`ss_tree_step`): the products become M-row GEMMs that read each weight
block once for all the step's tokens, and the attention sees the cache plus
the step's tokens its mask allows (kernels/cpu_tree_attention.c), so
verifying k drafts costs little more than a plain step.

It serves a model whose every linear layer holds a `QuantMatrix` (the GGUF
scheme on a CPU with the kernels built), fp32 activations and an fp32 or bf16
KV cache, batches where each sequence brings one token, or up to MAX_QUERY
tokens after a cached context (prompts take the model's forward: also a lone
one-token prompt, which would fit a decode step, so that it gets the same bits
as beside other prompts, where the step is the model's forward anyway; a short
rest of a prompt after a cached prefix still fits a verification step). Over a KIVI
cache (cache/kivi_paged.py) it serves decode steps: the window bookkeeping and
the sealing of blocks leaving the window run first (every layer, on the host),
then the C step stores the new rows in the window pools and its attention reads
sealed blocks from their codes (kernels/cpu_attention.py).
Everything else takes the model's own forward, which is also its twin
(`tests/loader/test_cpu_decoder.py` compares the two).
"""
from __future__ import annotations

import ctypes

import numpy as np
import torch

from slipstream.kernels import cpu_attention, cpu_library
from slipstream.kernels.cpu_quant import QuantMatrix

MAX_SEG = 8
MAX_QUERY = 64      # tokens a sequence may bring to a multi-token step (1 + drafts; mask bits)
enabled = True      # False: every step takes the model's forward (tests compare the two)


class _Linear(ctypes.Structure):
    _fields_ = [("n_seg", ctypes.c_int32), ("type", ctypes.c_int32 * MAX_SEG),
                ("w", ctypes.c_void_p * MAX_SEG), ("rows", ctypes.c_int64 * MAX_SEG),
                ("bias", ctypes.c_void_p)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear), ("down", _Linear),
                ("norm1", ctypes.c_void_p), ("norm2", ctypes.c_void_p),
                ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p),
                ("kivi", ctypes.c_void_p)]


class _Model(ctypes.Structure):
    _fields_ = [("n_layers", ctypes.c_int32), ("hidden", ctypes.c_int32), ("nh", ctypes.c_int32),
                ("nkv", ctypes.c_int32), ("hd", ctypes.c_int32), ("inter", ctypes.c_int32),
                ("block_size", ctypes.c_int32), ("kv_bf16", ctypes.c_int32),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("window", ctypes.c_int64),
                ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p), ("final_norm", ctypes.c_void_p),
                ("layers", ctypes.POINTER(_Layer)), ("n_taps", ctypes.c_int32),
                ("taps", ctypes.c_void_p), ("tap_out", ctypes.c_void_p),
                ("num_blocks", ctypes.c_int64), ("max_position", ctypes.c_int64)]

# run_step's codes (cpu_decoder.c check_step): the step's indices it refused
_REFUSED = {-1: "a shape the kernels do not take", -2: "a position outside the rotary tables",
            -3: "a slot outside the KV cache", -4: "a sequence's lengths (or its block-table width)",
            -5: "a block id outside the KV cache"}


def _fp32(t: torch.Tensor | None) -> bool:
    return t is None or (t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous())


def _linear(layer) -> _Linear | None:
    """The product's weights as the layer's own products read them (Q4/Q8 blocks
    repacked for 16 rows at a time): a multi-token step then reads each block
    once for all its tokens, and every token's row comes out bit for bit as in
    a one-token step (the rows of x never mix), so verified drafts reproduce
    plain greedy decoding exactly."""
    qm = getattr(layer, "gguf_weight", None)
    bias = getattr(layer, "bias", None)
    if not isinstance(qm, QuantMatrix) or not _fp32(bias):
        return None
    return linear_of(qm.kernel_segments, bias)


def linear_of(segments, bias: torch.Tensor | None = None) -> _Linear | None:
    """The C description of a product over (type, blocks) segments; None past MAX_SEG."""
    if len(segments) > MAX_SEG:
        return None
    lin = _Linear(n_seg=len(segments))
    for i, (qtype, data) in enumerate(segments):
        lin.type[i], lin.w[i], lin.rows[i] = qtype, data.data_ptr(), data.shape[0]
    lin.bias = bias.data_ptr() if bias is not None else None
    return lin


class CPUDecoder:
    """Build with `CPUDecoder.build(llama_model)`; None when the model does not qualify."""

    def __init__(self, model, layers: list[_Layer]):
        self.model = model                     # a LlamaModel (holds every tensor pointed to)
        self._layers = (_Layer * len(layers))(*layers)
        self._struct = self._describe(model, self._layers)
        self._caches: list = []                # the KV tensors the structures point to
        self._attns = [layer.self_attn.attn for layer in model.layers]
        self._lib = cpu_library.load()
        self._taps_key: tuple[int, ...] = ()    # the taps the structure points to
        self._taps = torch.zeros(0, dtype=torch.int32)
        self._kivi_structs: list = []            # a KIVI cache's descriptions, one a layer

    @staticmethod
    def _describe(model, layers) -> _Model:
        first = model.layers[0]
        attn = first.self_attn.attn
        rope = model.rotary_emb
        return _Model(
            n_layers=len(layers), hidden=first.input_layernorm.weight.shape[0], nh=attn.num_heads,
            nkv=attn.num_kv_heads, hd=attn.head_dim,
            inter=first.mlp.down_proj.gguf_weight.cols, eps=first.input_layernorm.eps,
            scale=attn.scale, window=attn.sliding_window or 0, cos=rope.cos.data_ptr(),
            sin=rope.sin.data_ptr(), final_norm=model.norm.weight.data_ptr(), layers=layers,
            max_position=rope.cos.shape[0])

    @classmethod
    def build(cls, model) -> "CPUDecoder | None":
        if cpu_library.load() is None:
            return None
        if getattr(model.layers[0].self_attn.o_proj, "tp_size", 1) > 1:
            return None    # a rank's step sums partial products across ranks: the layer path
        rope = model.rotary_emb
        tensors = [rope.cos, rope.sin, model.norm.weight]
        layers = []
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            parts = [_linear(attn.qkv_proj), _linear(attn.o_proj), _linear(mlp.gate_up_proj),
                     _linear(mlp.down_proj)]
            if any(p is None for p in parts):
                return None
            n1, n2 = layer.input_layernorm, layer.post_attention_layernorm
            if n1.eps != n2.eps or n1.eps != model.norm.eps:
                return None
            tensors += [n1.weight, n2.weight]
            layers.append(_Layer(*parts, norm1=n1.weight.data_ptr(), norm2=n2.weight.data_ptr()))
        if not all(_fp32(t) for t in tensors):
            return None
        a0 = model.layers[0].self_attn.attn
        if any((l.self_attn.attn.num_heads, l.self_attn.attn.num_kv_heads, l.self_attn.attn.head_dim,
                l.self_attn.attn.scale, l.self_attn.attn.sliding_window)
               != (a0.num_heads, a0.num_kv_heads, a0.head_dim, a0.scale, a0.sliding_window)
               for l in model.layers):
            return None
        return cls(model, layers)

    def _bind_caches(self) -> bool:
        """Point the structures at the layers' current KV caches; False if unsupported.
        Over a KIVI cache the caches are its window pools (cpu_attention.py reads the
        sealed blocks' codes through each layer's `kivi` description)."""
        kivi = self._attns[0].kivi is not None
        if kivi and not self._kivi_structs:
            self._kivi_structs = [cpu_attention.kivi_struct(a.kivi) for a in self._attns]
            for st, ks in zip(self._layers, self._kivi_structs):
                st.kivi = ctypes.addressof(ks)
        pairs = [(a.kivi.win_k, a.kivi.win_v) if kivi else (a.k_cache, a.v_cache) for a in self._attns]
        if self._caches and all(k is k2 and v is v2 for (k, v), (k2, v2) in zip(pairs, self._caches)):
            return True
        caches = pairs
        k0 = caches[0][0]
        if k0 is None or k0.device.type != "cpu" or k0.dtype not in (torch.float32, torch.bfloat16):
            return False
        for (k, v), st in zip(caches, self._layers):
            if k.dtype != k0.dtype or v.dtype != k0.dtype or not (k.is_contiguous() and v.is_contiguous()) \
                    or k.shape[1:] != k0.shape[1:] or v.shape != k.shape:
                return False
            st.k_cache, st.v_cache = k.data_ptr(), v.data_ptr()
        self._struct.block_size = k0.shape[1]
        self._struct.num_blocks = k0.shape[0]
        self._struct.kv_bf16 = int(k0.dtype == torch.bfloat16)
        self._caches = caches
        return True

    def accepts(self, batch) -> bool:
        if not (enabled and batch.input_ids.device.type == "cpu"
                and batch.max_seq_len <= self.model.rotary_emb.max_position):
            return False
        decode = batch.is_decode_only and batch.tree_mask is None
        if decode and min(batch.seq_lens_cpu) == 1:
            return False      # a one-token prompt: the per-layer path, as beside other prompts
        if not decode and (self._attns[0].kivi is not None or not self._verifies(batch)):
            return False      # (over a KIVI cache: decode steps only)
        return self._bind_caches()

    def _verifies(self, batch) -> bool:
        """A few tokens per sequence, each after a cached context (a draft check)."""
        return (batch.max_query_len <= MAX_QUERY and self._struct.nh // self._struct.nkv <= 32
                and all(s > q for s, q in zip(batch.seq_lens_cpu, batch.query_lens_cpu)))

    def __call__(self, x: torch.Tensor, batch) -> torch.Tensor:
        """x: [num_tokens, hidden] fp32 embeddings -> final normed hidden states, same
        shape, then the model's feature taps (`LlamaModel.feature_taps`) as more columns."""
        x = x.contiguous() if x.dtype == torch.float32 else x.float().contiguous()
        taps = self.model.feature_taps if batch.features else ()
        if taps != self._taps_key:
            self._taps = torch.tensor(taps, dtype=torch.int32)
            self._struct.n_taps, self._struct.taps = len(taps), self._taps.data_ptr()
            self._taps_key = taps
        out = None
        if taps:
            out = torch.empty(x.shape[0], len(taps) * x.shape[1])
            self._struct.tap_out = out.data_ptr()
        y = self._step(x, batch)
        return y if out is None else torch.cat([y, out], dim=1)

    def _step(self, x: torch.Tensor, batch) -> torch.Tensor:
        positions = batch.positions if batch.positions.dtype == torch.int64 else batch.positions.long()
        lens = batch.seq_lens if batch.seq_lens.dtype == torch.int32 else batch.seq_lens.int()
        tables = batch.block_tables if batch.block_tables.dtype == torch.int32 else batch.block_tables.int()
        slots = batch.slot_mapping if batch.slot_mapping.dtype == torch.int64 else batch.slot_mapping.long()
        positions, lens, tables, slots = (t.contiguous() for t in (positions, lens, tables, slots))
        if not (batch.is_decode_only and batch.tree_mask is None):
            return self._tree_step(x, batch, positions, lens, tables, slots)
        if self._attns[0].kivi is not None:
            slots = self._kivi_slots(batch)
        rc = self._lib.ss_decode_step(ctypes.byref(self._struct), x.data_ptr(), x.shape[0],
                                      positions.data_ptr(), tables.data_ptr(), tables.shape[1],
                                      lens.data_ptr(), slots.data_ptr())
        if rc != 0:
            raise _refused("decode", rc, batch)
        return x

    def _kivi_slots(self, batch) -> torch.Tensor:
        """A KIVI cache: every layer's window bookkeeping for the step's tokens and the
        blocks leaving the windows sealed; -> the tokens' rows in the window pools
        (the same in every layer: their bookkeeping runs the same calls)."""
        host = batch.host_block_tables()
        rows = None
        for a in self._attns:
            r = a.kivi.reserve(batch.slot_mapping, batch.slot_mapping_host)
            if rows is None:
                rows = r
            elif not np.array_equal(r, rows):
                raise RuntimeError("KIVI window slots differ between layers")
            a.kivi.seal_many(host, batch.seq_lens_cpu, newest_only=True)
        self._bind_caches()      # (a pool may have grown)
        return torch.from_numpy(rows)

    def _tree_step(self, x, batch, positions, lens, tables, slots) -> torch.Tensor:
        qlens = batch.query_lens_cpu
        qloc = batch.query_start_loc
        qloc = (qloc if qloc.dtype == torch.int32 else qloc.int()).contiguous()
        masks = cpu_attention.query_masks(qlens, batch.tree_mask)
        rc = self._lib.ss_tree_step(ctypes.byref(self._struct), x.data_ptr(), positions.data_ptr(),
                                    tables.data_ptr(), tables.shape[1], lens.data_ptr(), slots.data_ptr(),
                                    len(qlens), qloc.data_ptr(), masks.data_ptr(), batch.max_query_len)
        if rc != 0:
            raise _refused("multi-token", rc, batch)
        return x


def _refused(kind: str, rc: int, batch) -> RuntimeError:
    """The C step checks the step's indices before using any (a bad one would read
    or write outside the caches): what it refused, with the batch's shape."""
    return RuntimeError(
        f"the CPU {kind} step refused {_REFUSED.get(rc, f'its arguments ({rc})')}: seq_lens "
        f"{batch.seq_lens_cpu[:16]}, query_lens {batch.query_lens_cpu[:16]}, block table "
        f"{tuple(batch.block_tables.shape)}, slots {batch.slot_mapping.tolist()[:16]}, "
        f"positions {batch.positions.tolist()[:16]}")

"""EAGLE's draft head on the CPU in one C call (launcher for `cpu_eagle.c`).

On a CPU a draft level of the head is about 30 torch ops (norms, products,
rotary, attention with its mask, log-softmax, top-k, concatenations), whose
interpreter and dispatcher time is as large as the level's products (measured:
a chain of 3 drafted in 6.4 ms a round of which 2.7 ms were products). Here the
head's rows (`rows`: the head catching up on the target's states) and a whole
draft chain (`chain`: `depth` levels of the top k after the best token of the
level before, beam 1) are one call each over the same Q8_0 blocks the head's
layers hold on a CPU (spec/cpu_draft.py). Twins: EagleHead.forward and
EagleTreeExpander.levels (tests/spec/test_cpu_eagle.py compares them).
"""
from __future__ import annotations

import ctypes
import os

import torch

from slipstream.kernels import cpu_library
from slipstream.kernels.cpu_decoder import _Linear, linear_of
from slipstream.kernels.cpu_quant import QuantMatrix

# False (or SLIPSTREAM_CPU_EAGLE=0): the torch path (tests and benchmarks compare the two)
enabled = os.environ.get("SLIPSTREAM_CPU_EAGLE", "1") != "0"


class _Eagle(ctypes.Structure):
    _fields_ = [("hidden", ctypes.c_int32), ("nh", ctypes.c_int32), ("nkv", ctypes.c_int32),
                ("hd", ctypes.c_int32), ("inter", ctypes.c_int32), ("eps", ctypes.c_float),
                ("scale", ctypes.c_float), ("max_position", ctypes.c_int64),
                ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p),
                ("fc", _Linear), ("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear),
                ("down", _Linear), ("lm", _Linear), ("token_of_col", ctypes.c_void_p),
                ("attn_norm", ctypes.c_void_p), ("mlp_norm", ctypes.c_void_p),
                ("out_norm", ctypes.c_void_p), ("emb_type", ctypes.c_int32), ("emb", ctypes.c_void_p)]


def _linear(*matrices: QuantMatrix) -> _Linear | None:
    """Rows of one or more matrices (q, k, v: one product) as the matrices' own
    products read them (QuantMatrix.matmul's segments), so a row comes out as there."""
    if len({qm.cols for qm in matrices}) != 1:
        return None
    return linear_of([s for qm in matrices for s in qm.kernel_segments])


def _matrix(module) -> QuantMatrix | None:
    return getattr(module, "qm", None)     # spec/cpu_draft.QuantLinear


class CPUEagle:
    """`CPUEagle.build(head, lm_head, embed)`: None where the head does not qualify
    (its products not on Q8_0 blocks, a dense draft LM head, an embedding that is
    not one block table, the kernels not built)."""

    def __init__(self, head, lm_head, embed, struct: _Eagle, keep: list):
        self.head, self.lm_head, self.embed = head, lm_head, embed
        self.vocab = lm_head.vocab.long()       # draft column -> token id
        self._struct, self._keep = struct, keep     # keep: tensors the structure points into
        self._lib = cpu_library.load()

    @classmethod
    def build(cls, head, lm_head, embed) -> "CPUEagle | None":
        from slipstream.spec.cpu_draft import QuantDraftLMHead
        if cpu_library.load() is None or head.dtype != torch.float32:
            return None
        s = head.shape
        parts = [_matrix(getattr(head, n, None)) for n in ("fc", "q", "k", "v", "o", "gate_up", "down")]
        table = getattr(embed, "gguf_weight", None)
        if (any(p is None for p in parts) or not isinstance(lm_head, QuantDraftLMHead)
                or not isinstance(table, QuantMatrix) or len(table.segments) != 1
                or getattr(embed, "tp_size", 1) > 1):
            return None
        fc, q, k, v, o, gate_up, down = parts
        lins = [_linear(fc), _linear(q, k, v), _linear(o), _linear(gate_up), _linear(down),
                _linear(lm_head.rows)]
        if any(lin is None for lin in lins):
            return None
        rot = head.rotary
        vocab = lm_head.vocab.to(torch.int32).contiguous()
        keep = [rot.cos.float().contiguous(), rot.sin.float().contiguous(), vocab,
                head.attn_norm.detach().contiguous(), head.mlp_norm.detach().contiguous(),
                head.out_norm.detach().contiguous()]
        cos, sin, vocab, n1, n2, n3 = keep
        qtype, data = table.segments[0]
        struct = _Eagle(hidden=s.hidden_size, nh=s.num_heads, nkv=s.num_kv_heads, hd=s.head_dim,
                        inter=s.intermediate_size, eps=s.eps, scale=s.head_dim ** -0.5,
                        max_position=cos.shape[0], cos=cos.data_ptr(), sin=sin.data_ptr(),
                        fc=lins[0], qkv=lins[1], o=lins[2], gate_up=lins[3], down=lins[4],
                        lm=lins[5], token_of_col=vocab.data_ptr(), attn_norm=n1.data_ptr(),
                        mlp_norm=n2.data_ptr(), out_norm=n3.data_ptr(), emb_type=qtype,
                        emb=data.data_ptr())
        return cls(head, lm_head, embed, struct, keep + [data])

    @staticmethod
    def _past(k, v, valid):
        if k is None:
            e = torch.zeros(0)
            return e, e, torch.zeros(0, dtype=torch.uint8), 0
        return (k.float().contiguous(), v.float().contiguous(),
                valid.to(torch.uint8).contiguous(), k.shape[0])

    def rows(self, emb: torch.Tensor, feat: torch.Tensor, positions: torch.Tensor,
             past_k: torch.Tensor | None, past_v: torch.Tensor | None,
             valid: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """EagleHead.forward over t new rows that see the valid past and, causally,
        each other: emb, feat [t, hidden] -> (features [t, hidden], K, V [t, kv, d])."""
        s = self.head.shape
        t = emb.shape[0]
        emb, feat = emb.float().contiguous(), feat.float().contiguous()
        pos = positions.to(torch.int64).contiguous()
        pk, pv, ok, ctx = self._past(past_k, past_v, valid)
        f = torch.empty(t, s.hidden_size)
        k = torch.empty(t, s.num_kv_heads, s.head_dim)
        v = torch.empty_like(k)
        rc = self._lib.ss_eagle_pass(ctypes.byref(self._struct), emb.data_ptr(), feat.data_ptr(), t,
                                     pos.data_ptr(), pk.data_ptr(), pv.data_ptr(), ok.data_ptr(), ctx,
                                     k.data_ptr(), v.data_ptr(), f.data_ptr())
        if rc != 0:
            raise RuntimeError("ss_eagle_pass rejected its arguments")
        return f, k, v

    def chain(self, root_feat: torch.Tensor, past_k: torch.Tensor, past_v: torch.Tensor,
              valid: torch.Tensor | None, base: int, depth: int, topk: int,
              min_logp: float = float("-inf")) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (token ids [levels, topk] int64, their draft log-probabilities [levels, topk]):
        level 0 after the root, level l after the best token of level l - 1; `depth`
        levels, or those before the first whose best token's cumulative
        log-probability falls below min_logp (which is computed, then dropped)."""
        if valid is None:
            valid = torch.ones(past_k.shape[0], dtype=torch.bool)
        pk, pv, ok, ctx = self._past(past_k, past_v, valid)
        root = root_feat.float().contiguous()
        tokens = torch.empty(depth, topk, dtype=torch.int64)
        logp = torch.empty(depth, topk)
        kept = self._lib.ss_eagle_chain(ctypes.byref(self._struct), root.data_ptr(), pk.data_ptr(),
                                        pv.data_ptr(), ok.data_ptr(), ctx, int(base), depth, topk,
                                        float(min_logp), 0.0, None, None, tokens.data_ptr(),
                                        logp.data_ptr())
        if kept < 0:
            raise RuntimeError("ss_eagle_chain rejected its arguments")
        return tokens[:kept], logp[:kept]

    def sample_chain(self, root_feat: torch.Tensor, past_k: torch.Tensor, past_v: torch.Tensor,
                     valid: torch.Tensor | None, base: int, depth: int, temperature: float,
                     generator: torch.Generator | None = None,
                     min_logp: float = float("-inf")) -> tuple[torch.Tensor, torch.Tensor]:
        """A chain whose tokens are drawn: level l's from q_l = softmax(draft logits /
        temperature) after level l - 1's token -> (token ids [levels] int64, q [levels,
        V'] over the draft vocabulary, `vocab`'s columns); the levels before the first
        whose tokens' cumulative log q falls below min_logp. One uniform a level from
        `generator` (the request's) or torch's."""
        if not temperature > 0:
            raise ValueError(f"sample_chain: temperature must be > 0, got {temperature}")
        if valid is None:
            valid = torch.ones(past_k.shape[0], dtype=torch.bool)
        pk, pv, ok, ctx = self._past(past_k, past_v, valid)
        root = root_feat.float().contiguous()
        uniforms = torch.rand(depth, generator=generator)
        tokens = torch.empty(depth, 1, dtype=torch.int64)
        logq = torch.empty(depth, 1)
        q = torch.empty(depth, self.vocab.shape[0])
        kept = self._lib.ss_eagle_chain(ctypes.byref(self._struct), root.data_ptr(), pk.data_ptr(),
                                        pv.data_ptr(), ok.data_ptr(), ctx, int(base), depth, 1,
                                        float(min_logp), float(temperature), uniforms.data_ptr(),
                                        q.data_ptr(), tokens.data_ptr(), logq.data_ptr())
        if kept < 0:
            raise RuntimeError("ss_eagle_chain rejected its arguments")
        return tokens[:kept, 0], q[:kept]


def chain_table(tokens: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """A chain's levels -> EagleTreeExpander's candidate table [4, depth * topk] float64
    (token id, cumulative log-probability, parent candidate, level): level l's
    candidates are children of level l - 1's first (best) one."""
    depth, k = tokens.shape
    lp = logp.double()
    best = torch.cat([lp.new_zeros(1), lp[:-1, 0].cumsum(0)])      # score of each level's parent
    scores = best[:, None] + lp
    parents = torch.cat([torch.full((k,), -1.0, dtype=torch.float64),
                         (torch.arange(depth - 1, dtype=torch.float64) * k).repeat_interleave(k)])
    levels = torch.arange(1, depth + 1, dtype=torch.float64).repeat_interleave(k)
    return torch.stack([tokens.double().flatten(), scores.flatten(), parents, levels])

"""The cost of one operation of a forward pass: FLOPs and the bytes it must move.

Bytes are the minimum for an implementation that reads each input from and
writes each output to device memory once, with operations fused as the fast
kernels fuse them (the attention score matrix never leaves the chip; the
gated activation is computed in the gate/up GEMM's epilogue).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

_SUMMED = ("flops", "weight_bytes", "act_bytes", "kv_read_bytes", "kv_write_bytes",
           "params", "active_params", "stored_bytes")


@dataclass(frozen=True)
class OpCost:
    name: str
    flops: float = 0.0            # 2 x multiply-adds for matmuls; an estimate for elementwise ops
    weight_bytes: float = 0.0     # weights read (once per step, shared by the whole batch)
    act_bytes: float = 0.0        # activations read + written
    kv_read_bytes: float = 0.0
    kv_write_bytes: float = 0.0
    params: float = 0.0           # weights this op owns (all experts)
    active_params: float = 0.0    # weights one token uses (its routed experts only)
    stored_bytes: float = 0.0     # size of the weights it owns, at their precision
    matmul: bool = True           # False: elementwise (norms), FLOPs off the tensor cores

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.act_bytes + self.kv_read_bytes + self.kv_write_bytes

    @property
    def intensity(self) -> float:
        """FLOPs per byte moved; inf for an op that moves nothing."""
        return self.flops / self.bytes if self.bytes else float("inf")

    def __add__(self, other: "OpCost") -> "OpCost":
        return replace(self, **{f: getattr(self, f) + getattr(other, f) for f in _SUMMED})


def matmul(name: str, rows: float, d_in: int, d_out: int, weight_elem_bytes: float,
           act_elem_bytes: float, *, copies: int = 1, copies_read: float = 1.0,
           copies_active: float = 1.0, bias: bool = False, out_written: int | None = None,
           kv_write_bytes: float = 0.0) -> OpCost:
    """A GEMM of `rows` activation rows through a [d_in, d_out] weight.

    copies: weight matrices the op owns (experts); copies_read: how many of them
    this step touches; copies_active: how many one token uses. out_written: the
    output width that goes back to memory when part of it goes elsewhere (K and
    V into the cache) or is halved by a fused epilogue (SiLU(gate) * up).
    """
    per_copy = d_in * d_out + (d_out if bias else 0)
    written = d_out if out_written is None else out_written
    return OpCost(
        name=name,
        flops=2.0 * rows * d_in * d_out,
        weight_bytes=copies_read * per_copy * weight_elem_bytes,
        act_bytes=rows * (d_in + written) * act_elem_bytes,
        kv_write_bytes=kv_write_bytes,
        params=copies * per_copy,
        active_params=copies_active * per_copy,
        stored_bytes=copies * per_copy * weight_elem_bytes,
    )


def elementwise(name: str, rows: float, width: int, act_elem_bytes: float,
                flops_per_element: float, weights: int = 0, weight_elem_bytes: float = 0.0,
                passes: int = 1) -> OpCost:
    """`passes` independent read-modify-write sweeps over [rows, width]."""
    return OpCost(
        name=name,
        flops=passes * flops_per_element * rows * width,
        weight_bytes=weights * weight_elem_bytes,
        act_bytes=passes * 2 * rows * width * act_elem_bytes,
        params=weights,
        active_params=weights,
        stored_bytes=weights * weight_elem_bytes,
        matmul=False,
    )


def total(ops, name: str = "total") -> OpCost:
    acc = OpCost(name)
    for op in ops:
        acc = acc + op
    return acc

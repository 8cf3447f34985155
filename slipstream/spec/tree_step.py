"""The target-side layout of a step that verifies draft trees.

Before the forward, `TreeStepLayout.patch` sets each tree row's position
(context + depth: the packing gave it context + row) and the step's tree mask
([num_seqs, rows, rows] bool, a request's rows seeing the root and their
ancestors; rows of chains and plain requests stay causal). A CUDA-graph step
reads its mask from a static buffer per shape; a buffer that already holds a
causal mask is not rewritten for a step of chains. After verification,
`move_kv` copies the accepted nodes' K/V (and int8 / fp8 scales) to the slots
right after the root, every request of the step in one gather and scatter.
All host -> device copies go through pinned memory (spec/transfer.py).
"""
from __future__ import annotations

import numpy as np
import torch

from slipstream.kernels.kv_move import move_rows
from slipstream.spec.transfer import to_device
from slipstream.spec.tree import DraftTree, ancestor_array


class TreeStepLayout:
    def __init__(self):
        self._static: dict[tuple, torch.Tensor] = {}      # shape -> mask buffer graphs read
        self._causal: dict[tuple, bool] = {}              # the buffer holds a causal mask

    def patch(self, plan, trees: dict[str, DraftTree], static: bool = False) -> None:
        """plan: the packed step (runner/input_batch.StepPlan); trees: request
        id -> its staged tree. static: a CUDA-graph step (chains included)."""
        chains = all(t.is_chain for t in trees.values())
        if not trees or (not static and chains):
            return
        batch = plan.batch
        width = batch.max_query_len
        shape = (len(batch.query_lens_cpu), width, width)
        dev = batch.positions.device
        if static and chains and self._causal.get(shape):
            batch.tree_mask = self._static[shape]          # already causal: nothing to copy
            return
        mask = np.broadcast_to(np.tri(width, dtype=bool), shape).copy()
        loc = 0
        pos_idx, pos_val = [], []
        for i, (rid, s, q) in enumerate(zip(plan.req_ids, plan.starts, plan.query_lens)):
            t = trees.get(rid)
            if t is not None and not t.is_chain:
                n = t.num_nodes + 1
                mask[i, :n, :n] = ancestor_array(t.parents)
                pos_idx.extend(range(loc + 1, loc + n))
                pos_val.extend(int(s) + d for d in t.depths)
            loc += int(q)
        if pos_idx:
            pv = to_device(np.array([pos_idx, pos_val], dtype=np.int64), torch.int64, dev)
            batch.positions[pv[0]] = pv[1]
        mask_dev = to_device(mask, torch.bool, dev)
        if static:
            buf = self._static.get(shape)
            if buf is None:
                buf = self._static[shape] = torch.empty(shape, dtype=torch.bool, device=dev)
            buf.copy_(mask_dev)
            self._causal[shape] = chains
            batch.tree_mask = buf
        else:
            batch.tree_mask = mask_dev


def move_kv(pools: tuple, src: list[int], dst: list[int], device) -> None:
    """pools: [layers, 2, blocks, block_size, ...] tensors (or None). Copy the
    entries at slots `src` to `dst`; all sources are read before any write."""
    sd = to_device(np.array([src, dst], dtype=np.int64), torch.int64, device)
    for pool in pools:
        if pool is not None:
            move_rows(pool, sd[0], sd[1])

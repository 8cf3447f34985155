"""The runner's persistent per-request state, and the packing of one step's inputs.

Each request the runner holds owns a row (up to `max_num_seqs`): its token ids
on the host, its block table row (new blocks are appended, the table is never
rebuilt), how many of its tokens are known on the host and how many exist
(known plus tokens still being sampled on the device), and its sampling row
(`SamplingState`). State changes only through `SchedulerOutput` deltas.

A step's inputs are packed with numpy into fixed staging buffers (pinned on
CUDA) laid out at fixed offsets, then copied to the device in two copies, so a
captured CUDA graph can read any step's inputs from the same addresses:

    int64:  input_ids | positions | slot_mapping | logits_indices | pending_dst | pending_src
    int32:  query_start_loc | seq_lens | context_lens | block_tables [max_num_seqs, max_blocks]

Tokens still being sampled (the engine schedules a step before the previous
step's tokens reach the host) are read on the device from `last_sampled`,
which the sampler writes by row: `input_ids[pending_dst] = last_sampled[pending_src]`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from slipstream.batch import ForwardBatch
from slipstream.step_data import SchedulerOutput


@dataclass
class StepPlan:
    """Host-side facts of one packed step (the device tensors are in `batch`)."""
    batch: ForwardBatch
    req_ids: list[str]            # the step's requests, in batch order (decodes first)
    rows: np.ndarray              # [num_seqs] their rows
    sample_rows: np.ndarray       # [num_samples] rows of the requests that sample, batch order
    sample_req_ids: list[str]
    num_pending: int              # tokens read from last_sampled on the device
    pending_dst: torch.Tensor     # [num_pending] int64 (device)
    pending_src: torch.Tensor     # [num_pending] int64 (device)
    starts: np.ndarray            # [num_seqs] tokens computed before the step
    query_lens: np.ndarray        # [num_seqs]


class _Staging:
    """One set of staging buffers (host + device) at fixed offsets."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, device: torch.device,
                 host: bool = True):
        pin = device.type == "cuda"
        if not host:  # device buffers only (a CUDA graph's static inputs)
            self.T, self.S, self.W = max_tokens, max_seqs, max_blocks
            self.d64 = torch.zeros(6 * max_tokens, dtype=torch.int64, device=device)
            self.d32 = torch.zeros(3 * (max_seqs + 1) + max_seqs * max_blocks, dtype=torch.int32,
                                   device=device)
            return
        self.T, self.S, self.W = max_tokens, max_seqs, max_blocks
        n64 = 6 * max_tokens
        n32 = 3 * (max_seqs + 1) + max_seqs * max_blocks
        self.h64 = torch.zeros(n64, dtype=torch.int64, pin_memory=pin)
        self.h32 = torch.zeros(n32, dtype=torch.int32, pin_memory=pin)
        self.n64 = self.h64.numpy()
        self.n32 = self.h32.numpy()
        self.d64 = self.h64.to(device) if pin else self.h64
        self.d32 = self.h32.to(device) if pin else self.h32
        self.copied = torch.cuda.Event() if pin else None

    def sec64(self, i: int, arr: bool = False):
        lo = i * self.T
        return (self.n64 if arr else self.d64)[lo:lo + self.T]

    def sec32(self, i: int, arr: bool = False):
        lo = i * (self.S + 1)
        return (self.n32 if arr else self.d32)[lo:lo + self.S + 1]

    def tables(self, arr: bool = False):
        lo = 3 * (self.S + 1)
        buf = self.n32 if arr else self.d32
        return buf[lo:lo + self.S * self.W].reshape(self.S, self.W)


class InputBatch:
    def __init__(self, max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int,
                 block_size: int, device: torch.device):
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.max_blocks = -(-max_model_len // block_size)
        self.device = device
        n = max_num_seqs
        self.token_ids = np.zeros((n, max_model_len), dtype=np.int64)
        self.num_known = np.zeros(n, dtype=np.int64)    # tokens whose ids the host has
        self.num_tokens = np.zeros(n, dtype=np.int64)   # known + being sampled
        self.num_prompt = np.zeros(n, dtype=np.int64)
        self.block_table = np.zeros((n, self.max_blocks), dtype=np.int32)
        self.num_blocks = np.zeros(n, dtype=np.int64)
        self.req_ids: list[str | None] = [None] * n
        self.row_of: dict[str, int] = {}
        self._free_rows = list(range(n - 1, -1, -1))
        # A decode graph of any bucket reads the first rows of these buffers.
        self.max_tokens = max(max_num_batched_tokens, max_num_seqs)
        # Two staging sets: the host packs step N+1 while step N's copy may be in flight.
        self._staging = [_Staging(self.max_tokens, n, self.max_blocks, device) for _ in range(2)]
        self._flip = 0
        self._graph_static: _Staging | None = None   # created with the first graph step
        self.last_sampled = torch.zeros(n, dtype=torch.int64, device=device)

    # ---- state ------------------------------------------------------------

    @property
    def num_reqs(self) -> int:
        return len(self.row_of)

    def add(self, req_id: str, prompt: list[int], outputs: list[int], block_ids: list[int]) -> int:
        if not self._free_rows:
            raise RuntimeError("the input batch is full")  # the scheduler caps running requests
        row = self._free_rows.pop()
        tokens = len(prompt) + len(outputs)
        self.token_ids[row, :len(prompt)] = prompt
        self.token_ids[row, len(prompt):tokens] = outputs
        self.num_known[row] = self.num_tokens[row] = tokens
        self.num_prompt[row] = len(prompt)
        self.num_blocks[row] = 0
        self.append_blocks(row, block_ids)
        self.req_ids[row] = req_id
        self.row_of[req_id] = row
        return row

    def remove(self, req_id: str) -> int | None:
        row = self.row_of.pop(req_id, None)
        if row is not None:
            self.req_ids[row] = None
            self._free_rows.append(row)
        return row

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        if block_ids:
            b = self.num_blocks[row]
            self.block_table[row, b:b + len(block_ids)] = block_ids
            self.num_blocks[row] = b + len(block_ids)

    def append_known(self, row: int, tokens: list[int]) -> None:
        """Sampled tokens reached the host."""
        k = self.num_known[row]
        self.token_ids[row, k:k + len(tokens)] = tokens
        self.num_known[row] = k + len(tokens)

    # ---- one step -----------------------------------------------------------

    def plan(self, sched: SchedulerOutput, starts_by_req: dict[str, int],
             num_pad_seqs: int = 0, graph: bool = False) -> StepPlan:
        """Pack the step's inputs. `starts_by_req`: tokens computed before the step.
        `num_pad_seqs`: pad the batch with one-token dummy requests up to this many
        sequences (a CUDA graph bucket); dummies write no K/V (slot -1). `graph`:
        the device tensors are views of the buffers a captured graph reads."""
        ids = list(sched.num_scheduled_tokens)
        n_sched = np.fromiter(sched.num_scheduled_tokens.values(), dtype=np.int64, count=len(ids))
        # Decodes (one token) first: the backend sends them to the decode kernel.
        order = np.argsort(n_sched != 1, kind="stable")
        req_ids = [ids[i] for i in order]
        q = n_sched[order]
        rows = np.fromiter((self.row_of[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
        starts = np.fromiter((starts_by_req[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
        B, T = len(req_ids), int(q.sum())
        if T > self.max_tokens:
            raise ValueError(f"a step of {T} tokens exceeds the staging size {self.max_tokens}")
        cu = np.zeros(B + 1, dtype=np.int64)
        np.cumsum(q, out=cu[1:])
        tok_seq = np.repeat(np.arange(B), q)
        tok_row = rows[tok_seq]
        pos = np.arange(T) + np.repeat(starts - cu[:-1], q)
        seq_lens = starts + q
        samples = seq_lens == self.num_tokens[rows]
        pending = pos >= self.num_known[tok_row]

        self._flip ^= 1
        st = self._staging[self._flip]
        if st.copied is not None:
            st.copied.synchronize()   # the copy of two steps ago; long done in practice
        B_pad = max(B, num_pad_seqs)
        T_pad = T + (B_pad - B)
        ids64, pos64, slot64 = st.sec64(0, True), st.sec64(1, True), st.sec64(2, True)
        ids64[:T] = np.where(pending, 0, self.token_ids[tok_row, np.minimum(pos, self.max_model_len - 1)])
        pos64[:T] = pos
        slot64[:T] = (self.block_table[tok_row, pos // self.block_size].astype(np.int64)
                      * self.block_size + pos % self.block_size)
        ids64[T:T_pad] = 0
        pos64[T:T_pad] = 0
        slot64[T:T_pad] = -1
        sample_seq = np.flatnonzero(samples)
        logits_idx = cu[1:][sample_seq] - 1
        S = len(logits_idx)
        st.sec64(3, True)[:S] = logits_idx
        dst = np.flatnonzero(pending)
        P = len(dst)
        st.sec64(4, True)[:P] = dst
        st.sec64(5, True)[:P] = tok_row[dst]

        qsl, sl, cl = st.sec32(0, True), st.sec32(1, True), st.sec32(2, True)
        qsl[:B + 1] = cu
        qsl[B + 1:B_pad + 1] = T + np.arange(1, B_pad - B + 1)
        sl[:B] = seq_lens
        sl[B:B_pad] = 1
        cl[:B] = starts
        cl[B:B_pad] = 0
        width = int(-(-seq_lens.max() // self.block_size)) if B else 1
        tables = st.tables(True)
        tables[:B, :width] = self.block_table[rows, :width]
        tables[B:B_pad, :width] = 0
        n32 = 3 * (st.S + 1) + B_pad * st.W
        if st.copied is not None:
            st.d64.copy_(st.h64, non_blocking=True)
            st.d32[:n32].copy_(st.h32[:n32], non_blocking=True)
            st.copied.record()
        if graph:  # the graph's inputs live at fixed addresses
            if self._graph_static is None:
                self._graph_static = _Staging(st.T, st.S, st.W, self.device, host=False)
            self._graph_static.d64.copy_(st.d64)
            self._graph_static.d32[:n32].copy_(st.d32[:n32])
            st = self._graph_static

        num_decode = int(np.searchsorted(q != 1, True)) if B else 0
        batch = ForwardBatch(
            input_ids=st.sec64(0)[:T_pad], positions=st.sec64(1)[:T_pad],
            query_start_loc=st.sec32(0)[:B_pad + 1], seq_lens=st.sec32(1)[:B_pad],
            context_lens=st.sec32(2)[:B_pad], slot_mapping=st.sec64(2)[:T_pad],
            block_tables=st.tables()[:B_pad, :width] if not num_pad_seqs else st.tables()[:B_pad],
            logits_indices=st.sec64(3)[:S],
            max_query_len=int(q.max()) if B else 0, max_seq_len=int(seq_lens.max()) if B else 0,
            query_lens_cpu=q.tolist() + [1] * (B_pad - B),
            seq_lens_cpu=seq_lens.tolist() + [1] * (B_pad - B),
            num_decode_seqs=num_decode + (B_pad - B) if num_decode == B else num_decode,
            slot_mapping_host=slot64[:T_pad], block_tables_host=tables[:B_pad, :width],
        )
        sample_rows = rows[sample_seq]
        # The sampled tokens are on their way: later steps read them from last_sampled.
        self.num_tokens[sample_rows] += 1
        return StepPlan(batch=batch, req_ids=req_ids, rows=rows, sample_rows=sample_rows,
                        sample_req_ids=[req_ids[i] for i in sample_seq], num_pending=P,
                        pending_dst=st.sec64(4)[:P], pending_src=st.sec64(5)[:P],
                        starts=starts, query_lens=q)

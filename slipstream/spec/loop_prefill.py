"""The EAGLE loop's prefill (spec/eagle_loop.py): the prompt's forward, the
head over its pairs and the first tree. On a GPU these replay a CUDA graph per
prompt-length class (a power of two >= 64): the prompt is padded after its
end, so causal attention keeps the real rows exact, and the pad rows' K/V lie
past the context, rewritten by later rounds. A new graph is checked once
against the eager prefill, which stays the fallback."""
from __future__ import annotations

import torch

from slipstream.batch import ForwardBatch


class LoopPrefill:
    """Mixin of EagleLoop: reads and writes its static state."""

    def _prefill(self, prompt: list[int]) -> int:
        """The prompt's forward, the head over its pairs and the first tree; on a
        GPU from a CUDA graph per prompt-length class (the prompt padded: the pad
        rows come after the real ones, so causal attention keeps the real rows
        exact; their K/V lie past the context and are rewritten later)."""
        p = len(prompt)
        size = max(64, 1 << (p - 1).bit_length())
        if not self.graphs or size > self.max_len or self.prefill_graphs.get(size) is False:
            return self._prefill_eager(prompt)
        ids = torch.tensor(prompt + [0] * (size - p), dtype=torch.int64)
        entry = self.prefill_graphs.get(size)
        if entry is None:
            self._prefill_eager(prompt)                  # compiles; the reference
            want = self.root.clone()
            try:
                entry = self._capture_prefill(size)
                entry[1]["ids"].copy_(ids)
                entry[1]["last"].fill_(p - 1)
                entry[0].replay()
                # The first token must match; the draft table may differ in near-ties
                # (the padded rows change the products' rounding in 16-bit types).
                if not (torch.equal(self.root, want) and bool(self.table[1].isfinite().all())):
                    raise RuntimeError("the replayed prefill differs from the eager one")
            except Exception as e:   # noqa: BLE001 - the eager prefill stays correct
                import warnings
                warnings.warn(f"eagle loop: prefill graphs are off: {e!r}")
                torch.cuda.synchronize()
                self.prefill_graphs[size] = False
                return self._prefill_eager(prompt)
            self.prefill_graphs[size] = entry
            return int(self.root)
        graph, buf = entry
        buf["ids"].copy_(ids)
        buf["last"].fill_(p - 1)
        graph.replay()
        return int(self.root)

    def _capture_prefill(self, size: int) -> tuple:
        dev = self.dev
        buf = dict(ids=torch.zeros(size, dtype=torch.int64, device=dev),
                   last=torch.zeros((), dtype=torch.int64, device=dev),
                   pos=torch.arange(size, device=dev),
                   loc=torch.tensor([0, size], dtype=torch.int32, device=dev),
                   lens=torch.full((1,), size, dtype=torch.int32, device=dev),
                   ctx=torch.zeros(1, dtype=torch.int32, device=dev),
                   rows=torch.arange(self.hvalid.shape[0], device=dev))
        self._prefill_body(buf, size)                    # compiles this size's kernels
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._prefill_body(buf, size)
        return graph, buf

    def _prefill_body(self, buf: dict, size: int) -> None:
        """The padded prefill from static buffers (made outside any capture):
        ids [size], last = p - 1."""
        ids, last, pos = buf["ids"], buf["last"], buf["pos"]
        batch = ForwardBatch(
            input_ids=ids, positions=pos, query_start_loc=buf["loc"], seq_lens=buf["lens"],
            context_lens=buf["ctx"], slot_mapping=self.slot_of[:size], block_tables=self.block_table,
            logits_indices=last.view(1), max_query_len=size, max_seq_len=size,
            query_lens_cpu=[size], seq_lens_cpu=[size])
        self.backend.prepare(batch)
        hidden = self.model(batch)                                         # [size, hidden]
        first = self.model.compute_logits(hidden.index_select(0, last.view(1))).argmax(-1)
        dt = self.head.dtype
        toks = ids.roll(-1).scatter(0, last.view(1), first)                # pair j: (f_j, t_{j+1})
        f, k, v = self.head(self.embed(toks).to(dt), self.head.target_feature(hidden), pos, None, None)
        self.hk[:size].copy_(k)
        self.hv[:size].copy_(v)
        self.hvalid.copy_(buf["rows"] <= last)
        self.hptr.copy_(last + 1)
        self.n_ctx.copy_(last + 1)
        self.root.copy_(first[0])
        self.feat.copy_(f.index_select(0, last.view(1))[0])
        self.table.copy_(self._levels(self.feat, self.hk, self.hv, self.hvalid, self.n_ctx))

    def _prefill_eager(self, prompt: list[int]) -> int:
        p, dev = len(prompt), self.dev
        ids = torch.tensor(prompt, dtype=torch.int64, device=dev)
        pos = torch.arange(p, device=dev)
        batch = ForwardBatch(
            input_ids=ids, positions=pos,
            query_start_loc=torch.tensor([0, p], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([p], dtype=torch.int32, device=dev),
            context_lens=torch.zeros(1, dtype=torch.int32, device=dev),
            slot_mapping=self._slots(pos), block_tables=self.block_table,
            logits_indices=torch.tensor([p - 1], device=dev), max_query_len=p, max_seq_len=p,
            query_lens_cpu=[p], seq_lens_cpu=[p])
        self.backend.prepare(batch)
        hidden = self.model(batch)                                         # [P, hidden]
        first = self.model.compute_logits(hidden[-1:]).argmax(-1)          # [1]
        dt = self.head.dtype
        toks = torch.cat([ids[1:], first])                                 # pair j: (f_j, t_{j+1})
        f, k, v = self.head(self.embed(toks).to(dt), self.head.target_feature(hidden), pos, None, None)
        self.hk[:p], self.hv[:p] = k, v
        self.hvalid.zero_()
        self.hvalid[:p] = True
        self.hptr.fill_(p)
        self.n_ctx.fill_(p)
        self.root.copy_(first[0])
        self.feat.copy_(f[-1])
        self._expand()
        return int(first[0])

    def _expand(self) -> None:
        """The first tree after a prompt: eagerly once (the table's shape), then
        from a CUDA graph of its own (about 50 launches a level, from Python
        otherwise)."""
        def levels():
            return self._levels(self.feat, self.hk, self.hv, self.hvalid, self.n_ctx)
        if self.table is None:
            self.table = levels().clone()
            return
        if self.graphs and self.expand_graph is None:
            try:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    self.table.copy_(levels())
                self.expand_graph = graph
            except Exception as e:   # noqa: BLE001 - the eager expansion stays correct
                import warnings
                warnings.warn(f"eagle loop: no graph for the first expansion: {e!r}")
                torch.cuda.synchronize()
                self.expand_graph = False
        if self.expand_graph:
            self.expand_graph.replay()
        else:
            self.table.copy_(levels())

"""CUDA graphs for steps with prompt tokens, in pieces around attention.

A decode graph cannot serve a step that carries prompt tokens: its attention
depends on how the step's tokens split into requests. Everything else in the
forward (embedding, norms, linear layers, SiLU, residual adds) treats each
token row on its own and depends only on the token count. Such a step is padded
to a token bucket (16, 32, ... 512, then steps of 64) and runs as L + 1
captured pieces with the L attention calls eager between them (vLLM's
piecewise graphs):

    piece 0      embedding; layer 0's norm and QKV projection
    attention 0  eager: the step's real batch, its first T rows
    piece 1      layer 0's output projection, norm and MLP; layer 1's norm and QKV
    ...
    piece L      the last layer's output projection and MLP; the final norm

The host then launches 2L + 1 things a step instead of about ten kernels a layer.
Each attention layer's `intercept` marks where a piece ends: while capturing it
closes the current graph, records the layer's q / k / v views (static addresses
in the graph pool) and hands back the static buffer the next piece reads the
attention output from. Rows past T carry stale but finite values through the
row-wise ops and are never read.

A bucket's pieces are captured on its first use, after an eager run of the same
pieces (kernels compile, quantized kernels tune for the row count) that also
computes that step. `mode="eager"` runs the pieces without graphs (CPU tests,
debugging).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from dataclasses import dataclass

import torch

from slipstream.batch import ForwardBatch
from slipstream.layers.rotary import StepRotary
from slipstream.runner.cuda_graph import smallest_bucket


def token_buckets(max_tokens: int) -> list[int]:
    sizes = list(range(16, 513, 16)) + list(range(576, max_tokens + 64, 64))
    return sorted({min(s, max_tokens) for s in sizes})


@dataclass
class _Call:
    """One captured attention call: its layer, static inputs and output buffer."""
    layer: object
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    rope: StepRotary | None
    out: torch.Tensor


@dataclass
class _Pieces:
    graphs: list            # L + 1 CUDA graphs
    calls: list[_Call]      # L attention calls, one after each graph but the last
    hidden: torch.Tensor    # [bucket, hidden] final hidden states (static)


def piecewise_mode(config, tp, backend: str) -> str | None:
    """How steps with prompt tokens run: "graphs" (captured
    pieces around attention; with the decode graphs on one GPU), "eager" (the same
    pieces without graphs, any device: SLIPSTREAM_PIECEWISE_GRAPHS=eager) or None
    (the plain forward; SLIPSTREAM_PIECEWISE_GRAPHS=0). Under tensor parallelism
    the pieces hold the layers' all-reduces; captured there only when asked
    (SLIPSTREAM_PIECEWISE_GRAPHS=tp: every rank captures the same buckets in the
    same steps, as with the decode graphs; not yet run on two GPUs)."""
    mode = os.environ.get("SLIPSTREAM_PIECEWISE_GRAPHS", "1")
    if mode == "0" or (tp is not None and mode not in ("eager", "tp")):
        return None
    if mode == "eager":
        return "eager"
    if config.device.type != "cuda" or config.enforce_eager or backend != "triton":
        return None   # the decode graphs' conditions: their pool holds the pieces
    return "graphs"


class PiecewiseGraphs:
    def __init__(self, model, max_tokens: int, device: torch.device, pool=None,
                 mode: str = "graphs"):
        """mode: "graphs" (CUDA) or "eager" (the same pieces, run directly)."""
        self.model = model
        self.layers = model.attention_layers()
        self.mode = mode
        self.buckets = token_buckets(max_tokens)
        self.ids = torch.zeros(self.buckets[-1], dtype=torch.int64, device=device)
        self.pos = torch.zeros(self.buckets[-1], dtype=torch.int64, device=device)
        self.pool = pool if pool is not None or mode != "graphs" else torch.cuda.graph_pool_handle()
        self.pieces: dict[int, _Pieces] = {}
        self._bufs: dict[tuple, torch.Tensor] = {}   # static buffers (_buffer)
        self._graph = None
        self.enabled = True   # off after a capture failed: the runner goes eager

    def bucket_for(self, num_tokens: int) -> int | None:
        return smallest_bucket(self.buckets, num_tokens)

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """One step (the backend prepared for it) -> hidden states [num_tokens, hidden].
        The caller checked `bucket_for(batch.num_tokens)`; the rows are valid until
        the next run."""
        t = batch.num_tokens
        tb = self.bucket_for(t)
        self.ids[:t].copy_(batch.input_ids)
        self.pos[:t].copy_(batch.positions)
        pieces = self.pieces.get(tb)
        if pieces is None:
            hidden = self._eager(batch, tb)
            if self.mode == "graphs":
                try:
                    self.pieces[tb] = self._capture(batch, tb)
                except Exception as e:   # noqa: BLE001 - the eager forward stays correct
                    warnings.warn(f"piecewise CUDA graphs are off: {e!r}")
                    self.enabled = False
            return hidden[:t]
        for i, graph in enumerate(pieces.graphs):
            graph.replay()
            if i < len(pieces.calls):
                self._attend(pieces.calls[i], batch, t)
        return pieces.hidden[:t]

    # ---- the pieces -----------------------------------------------------------

    def _static(self, batch: ForwardBatch, tb: int) -> ForwardBatch:
        return dataclasses.replace(batch, input_ids=self.ids[:tb], positions=self.pos[:tb])

    def _buffer(self, kind: str, like: torch.Tensor, tb: int) -> torch.Tensor:
        """A static buffer [tb, *like.shape[1:]]: the first rows of one buffer sized for
        the largest bucket, shared by every bucket (one bucket replays at a time) and
        allocated outside any capture (by the eager run that precedes it), zeroed so
        that pad rows stay finite."""
        key = (kind, tuple(like.shape[1:]), like.dtype)
        buf = self._bufs.get(key)
        if buf is None:
            buf = self._bufs[key] = torch.zeros((self.buckets[-1], *like.shape[1:]),
                                                dtype=like.dtype, device=like.device)
        return buf[:tb]

    def _static_inputs(self, q, k, v, tb: int):
        """q, k, v copied into static buffers, so that no layer's QKV output stays
        pinned in the graph pool: one contiguous copy when they share their rows (head
        slices of the fused QKV projection's output, whatever tensor that is a view
        of), else three."""
        row = q.stride(0)
        lo = min(x.storage_offset() for x in (q, k, v))
        ptr = q.untyped_storage().data_ptr()
        if all(x.untyped_storage().data_ptr() == ptr and x.stride(0) == row and x.shape[0] == tb
               and x.storage_offset() - lo + _row_extent(x) <= row for x in (q, k, v)):
            rows = q.as_strided((tb, row), (row, 1), lo)       # the [tb, row] span they share
            buf = self._buffer("qkv", rows, tb)
            buf.copy_(rows)
            shift = buf.storage_offset() - lo
            return tuple(buf.as_strided(x.shape, x.stride(), x.storage_offset() + shift)
                         for x in (q, k, v))
        out = []
        for name, x in (("q", q), ("k", k), ("v", v)):
            buf = self._buffer(name, x, tb)
            buf.copy_(x)
            out.append(buf)
        return tuple(out)

    @staticmethod
    def _attend(call: _Call, batch: ForwardBatch, t: int) -> None:
        layer, rope, out = call.layer, call.rope, call.out[:t]
        q, k, v = call.q[:t], call.k[:t], call.v[:t]
        kw = {}
        if rope is not None:
            gathered = None if rope.gathered is None else tuple(x[:t] for x in rope.gathered)
            kw["rope"] = StepRotary(rope.positions[:t], rope.cos_table, rope.sin_table, gathered)
        layer.backend.forward(q, k, v, layer, batch, out=out, **kw)

    @contextlib.contextmanager
    def _intercepted(self, hook):
        for layer in self.layers:
            layer.intercept = hook
        try:
            yield
        finally:
            for layer in self.layers:
                layer.intercept = None

    def _eager(self, batch: ForwardBatch, tb: int) -> torch.Tensor:
        t = batch.num_tokens

        def hook(layer, q, k, v, rope):
            q, k, v = self._static_inputs(q, k, v, tb)   # makes the buffers the capture uses
            call = _Call(layer, q, k, v, rope, self._buffer("out", q, tb))
            self._attend(call, batch, t)
            return call.out
        with self._intercepted(hook):
            hidden = self.model(self._static(batch, tb))
        if self.mode == "graphs":
            self._buffer("hidden", hidden, tb)   # for the capture to copy into
        return hidden

    def _capture(self, batch: ForwardBatch, tb: int) -> _Pieces:
        graphs, calls = [], []

        def hook(layer, q, k, v, rope):
            q, k, v = self._static_inputs(q, k, v, tb)
            graph, self._graph = self._graph, None
            graph.capture_end()
            graphs.append(graph)
            out = self._buffer("out", q, tb)
            calls.append(_Call(layer, q, k, v, rope, out))
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=self.pool)
            self._graph = graph   # capturing
            return out

        # The static buffers exist already (the eager run of this bucket made them):
        # the pool holds only what lives inside a piece, reused by every bucket.
        torch.cuda.synchronize()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), self._intercepted(hook):
            self._graph = torch.cuda.CUDAGraph()
            self._graph.capture_begin(pool=self.pool)
            try:
                hidden = self.model(self._static(batch, tb))
                static_hidden = self._buffer("hidden", hidden, tb)
                static_hidden.copy_(hidden)
            finally:   # end whichever capture is open, also on an error
                graph, self._graph = self._graph, None
                if graph is not None:
                    graph.capture_end()
            graphs.append(graph)
        torch.cuda.current_stream().wait_stream(stream)
        return _Pieces(graphs, calls, static_hidden)


def _row_extent(x: torch.Tensor) -> int:
    """Elements one row of x spans in its storage (from its first to its last)."""
    return 1 + sum((n - 1) * st for n, st in zip(x.shape[1:], x.stride()[1:]))

"""CUDA graphs for decode steps: one launch replays the whole forward.

A decode step of an 8B model issues hundreds of kernels; launching them from
Python costs more than the GPU needs to run them at small batch sizes. Each
decode step is padded to a batch-size bucket (1, 2, 4, 8, 16, 24, 32, ... up to
`max_num_seqs`) and replays a graph captured for that bucket. The graph reads
its inputs from the input batch's static buffers and its attention metadata is
fixed per graph: the split-KV count is chosen for a context class (the next
power of two of the longest context, at least 512), so the key is (bucket,
splits, whether the class takes the short-context decode kernel). Graphs are
captured on first use (an eager run of the same step first compiles any
kernel), or ahead of serving (engine/warmup.py), all in one memory pool.
"""
from __future__ import annotations

import bisect

import torch

from slipstream.batch import ForwardBatch
from slipstream.config import ModelConfig


def smallest_bucket(buckets: list[int], n: int) -> int | None:
    """The first of the sorted `buckets` that holds n, or None."""
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


def graph_buckets(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4] + list(range(8, max_num_seqs + 8, 8))
    return sorted({min(s, max_num_seqs) for s in sizes})


class DecodeGraphs:
    def __init__(self, model, backend, mc: ModelConfig, max_num_seqs: int, max_model_len: int):
        from slipstream.kernels.decode_attention import choose_num_splits
        self.model, self.backend = model, backend
        self.buckets = graph_buckets(max_num_seqs)
        self.max_model_len = max_model_len
        self._group = mc.num_attention_heads // mc.num_key_value_heads
        self._kv_heads = mc.num_key_value_heads
        self._choose = choose_num_splits
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def bucket_for(self, num_seqs: int) -> int | None:
        return smallest_bucket(self.buckets, num_seqs)

    def splits_for(self, bucket: int, max_seq_len: int) -> int:
        context_class = min(max(512, 1 << max(max_seq_len - 1, 1).bit_length()), self.max_model_len)
        return self._choose(bucket, self._kv_heads, context_class, group=self._group)

    # Set while graphs are captured ahead of serving (engine/warmup.py): a decode step
    # then also captures its bucket's graphs for the longer context classes.
    capture_every_class = False

    def run(self, batch: ForwardBatch, bucket: int) -> torch.Tensor:
        """batch: a decode step padded to `bucket` sequences, in the static buffers.
        Returns the final hidden states [bucket, hidden] (valid until the next replay)."""
        if self.capture_every_class:
            self._capture_classes(batch, bucket)
        key = self._key(batch, bucket)
        entry = self.graphs.get(key)
        if entry is None:
            entry = self.graphs[key] = self._capture(batch)
        graph, out = entry
        graph.replay()
        return out

    def _key(self, batch: ForwardBatch, bucket: int) -> tuple:
        """The graph key of a padded decode step; sets the step's split count."""
        from slipstream.kernels.decode_configs import SHORT_MAX_LEN
        splits = self.splits_for(bucket, batch.max_seq_len)
        batch.decode_splits = splits
        # Unsplit steps up to SHORT_MAX_LEN run another attention kernel: a graph of its own.
        return (bucket, splits, batch.max_seq_len <= SHORT_MAX_LEN)

    def _capture(self, batch: ForwardBatch) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # Eager first: compiles kernels for these shapes and computes this step
        # (the replay recomputes the same values).
        self.backend.prepare(batch)
        self.model(batch)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.backend.prepare(batch)
            out = self.model(batch)
        return graph, out

    def _capture_classes(self, batch: ForwardBatch, bucket: int) -> None:
        """`bucket`'s graphs for the context classes past the short one, captured
        from this step with its longest context declared as each class's bound:
        a graph depends on the bound only through the split count and the choice
        of the short-context kernel (the kernels read each request's length from
        the device), so it serves every later step of its class. Each capture
        runs the step again, rewriting its tokens' K/V (the warm-up's own)."""
        real = batch.max_seq_len
        c = 1024
        bounds = []
        while c < self.max_model_len:
            bounds.append(c)
            c *= 2
        if self.max_model_len > 512:
            bounds.append(self.max_model_len)
        try:
            for bound in bounds:
                batch.max_seq_len = bound
                key = self._key(batch, bucket)
                if key not in self.graphs:
                    self.graphs[key] = self._capture(batch)
        finally:
            batch.max_seq_len = real

    # ---- one request verifying a draft tree --------------------------------------

    trees_enabled = True   # off after a captured tree step disagreed with its eager run

    def run_tree(self, batch: ForwardBatch) -> torch.Tensor | None:
        """batch: one request's root + draft nodes (T rows) with `tree_mask` and
        positions set, in the static buffers (tree masks of one T share a static
        buffer). Returns the final hidden states [T, hidden] (valid until the next
        replay), or None when tree graphs are off: the caller then runs eagerly.
        A new graph is checked once against the eager forward of the same step."""
        if not self.trees_enabled:
            return None
        t = batch.input_ids.shape[0]
        context_class = min(max(512, 1 << max(batch.max_seq_len - 1, 1).bit_length()),
                            self.max_model_len)
        splits = self._choose(1, self._kv_heads, context_class, max_query_len=t,
                              group=self._group)
        batch.decode_splits = splits
        key = ("tree", t, splits)
        entry = self.graphs.get(key)
        if entry is None:
            try:
                self.backend.prepare(batch)
                eager = self.model(batch).clone()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    self.backend.prepare(batch)
                    out = self.model(batch)
                graph.replay()
                err = (out.float() - eager.float()).abs().max().item()
                scale = eager.float().abs().max().item()
                if not err <= 0.02 * max(scale, 1.0):
                    raise RuntimeError(f"replay differs from the eager forward by {err:.3g}")
            except Exception as e:   # noqa: BLE001 - eager verification stays correct
                import warnings
                warnings.warn(f"CUDA graphs for tree verification are off: {e!r}")
                self.trees_enabled = False
                return None
            entry = self.graphs[key] = (graph, out)
            return out
        graph, out = entry
        graph.replay()
        return out


"""Greedy EAGLE decoding of one request with every round on the device.

The engine's speculation round is serial: host work (schedule, pack, tree
mask), the verification forward, then a wait and host work again (accept,
scheduler, detokenize). On a 135M model a plain step costs about what its
launches cost, so that host work alone eats the gain of a dynamic tree. Here
a round reads nothing from the host and the host waits on nothing: from the
candidate table of the last expansion it

  1. selects the tree (the `max_nodes` best candidates, ordered by level then
     score: a child never scores above its parent, so the set is closed under
     ancestors) and its ancestor mask, on the device;
  2. writes root + tree into a static ForwardBatch (positions context + depth,
     slots context + row) and runs the target over it (tree attention);
  3. verifies greedily (a node is accepted iff every node on its path is the
     target's argmax at its parent: sibling tokens are distinct), moves the
     accepted nodes' K/V to the slots after the root (a fixed D moves, the
     unused ones in place);
  4. runs the head over the D + 1 possible new pairs (past the accepted count
     masked) into static K/V buffers and expands the next tree;
  5. appends the emitted tokens to a device ring.

On a GPU the whole round is one CUDA graph (captured per generation length
class, checked against the eager round), replayed back to back; the host
copies the ring once per batch of rounds, sized so that no request can pass
its max_tokens inside a batch. Scope: one request, greedy, the EAGLE head;
the engine's own path (spec/speculator.py) covers everything else.
"""
from __future__ import annotations

import math
import time

import torch

from slipstream.batch import ForwardBatch
from slipstream.kernels.kv_move import move_rows
from slipstream.spec.eagle import EagleHead
from slipstream.spec.eagle_tree import COMPILED_SORT_MAX, EagleTreeExpander
from slipstream.spec.heads import DraftLMHead, read_draft_vocab, resolve_head
from slipstream.spec.loop_parts import LoopParts
from slipstream.spec.loop_prefill import LoopPrefill


class EagleLoop(LoopPrefill, LoopParts):
    def __init__(self, llm, head_path: str | None = None, depth: int = 6, topk: int = 8,
                 beam: int = 8, max_nodes: int = 48, max_len: int = 1024, graphs: bool = True,
                 compile_expansion: bool = False):
        """compile_expansion: the tree expansion and the round's other parts
        between its state writes through torch.compile (fuses small ops;
        experimental, the plain functions run after any error)."""
        from slipstream.kernels.decode_attention import MAX_TREE_NODES
        if max_nodes + 1 > MAX_TREE_NODES or min(depth, topk, beam, max_nodes) < 1:
            raise ValueError(f"eagle loop: depth, topk, beam >= 1 and 1 <= max_nodes < "
                             f"{MAX_TREE_NODES}, got {depth}, {topk}, {beam}, {max_nodes}")
        width = total = topk                         # candidates the expansion leaves
        for _ in range(depth - 1):
            width = min(beam, width) * topk
            total += width
        if max_nodes > total:
            raise ValueError(f"eagle loop: max_nodes {max_nodes} exceeds the {total} candidates "
                             f"of depth {depth}, topk {topk}, beam {beam}")
        engine = getattr(llm, "engine", llm)          # an LLM or its Engine
        runner = engine.runner
        self.model, self.backend = runner.model, runner.backend
        self._bits_only = getattr(self.backend, "takes_tree_bits", False)
        self.pools = (runner.kv_cache, runner.kv_scales)
        self.block_pool = engine.scheduler.kv.pool
        self.bs = engine.config.cache.block_size
        self.dev = dev = runner.device
        dtype = runner.dtype
        path = resolve_head(head_path, "eagle")
        self.head = EagleHead.load(path, dev, dtype)
        self.model.set_feature_taps(self.head.shape.taps)   # EAGLE-3 heads read the target's layers
        self.lm_head = DraftLMHead(self.model, read_draft_vocab(path), dtype, dev)
        self.embed = self.model.model.embed_tokens
        self.expander = EagleTreeExpander(self.head, self.embed, self.lm_head,
                                          self.lm_head.token_ids, depth, topk, beam)
        self.depth, self.nodes = depth, max_nodes
        parts = (self.expander.levels, self._tree, self._feed, self._accept, self._pairs,
                 self._commit)
        self.compile_error: str | None = None
        if compile_expansion:
            self.expander.sort_max = COMPILED_SORT_MAX if dev.type == "cuda" else None
            parts = tuple(self._compiled(torch.compile(f, dynamic=False), f) for f in parts)
        (self._levels, self._tree_fn, self._feed_fn, self._accept_fn, self._pairs_fn,
         self._commit_fn) = parts
        self.max_len = max_len
        self.graphs = graphs and dev.type == "cuda"
        self.graph = None
        self.graph_matches: bool | None = None
        self.graph_error: str | None = None
        self.expand_graph = None
        self.prefill_graphs: dict[int, tuple | bool] = {}   # prompt length class -> graph
        self.seconds = {"prefill": 0.0, "rounds": 0.0}   # host wall time, summed
        self.batches = 0
        self.rounds = self.emitted = 0
        s = self.head.shape
        t, i64 = max_nodes + 1, dict(dtype=torch.int64, device=dev)
        m = max_len + depth + 2                      # head pairs
        self.nblocks = math.ceil((max_len + t + depth + 2) / self.bs)
        # Static state (the graph reads and writes these).
        self.block_table = torch.zeros(1, self.nblocks, dtype=torch.int32, device=dev)
        self.slot_of = torch.zeros(self.nblocks * self.bs, **i64)   # position -> KV slot
        self.n_ctx = torch.zeros((), **i64)          # tokens in the cache; the root sits at n_ctx
        self.root = torch.zeros((), **i64)
        self.feat = torch.zeros(s.hidden_size, dtype=dtype, device=dev)
        self.hk = torch.zeros(m, s.num_kv_heads, s.head_dim, dtype=dtype, device=dev)
        self.hv = torch.zeros_like(self.hk)
        self.hvalid = torch.zeros(m, dtype=torch.bool, device=dev)
        self.hptr = torch.zeros((), **i64)
        self.table = None                            # [4, C] float64, set by the first expansion
        self.ring = torch.zeros(max_len + 1, depth + 2, **i64)   # per round: count, tokens
        self.rix = torch.zeros((), **i64)
        self.rows = torch.arange(t, **i64)
        self.batch = ForwardBatch(
            input_ids=torch.zeros(t, **i64), positions=torch.zeros(t, **i64),
            query_start_loc=torch.tensor([0, t], dtype=torch.int32, device=dev),
            seq_lens=torch.zeros(1, dtype=torch.int32, device=dev),
            context_lens=torch.zeros(1, dtype=torch.int32, device=dev),
            slot_mapping=torch.zeros(t, **i64), block_tables=self.block_table,
            logits_indices=self.rows.clone(), max_query_len=t, max_seq_len=max_len,
            query_lens_cpu=[t], seq_lens_cpu=[max_len],
            tree_mask=torch.zeros(1, t, t, dtype=torch.bool, device=dev),
            tree_bits=torch.zeros(1, t, **i64))
        if dev.type == "cuda":
            from slipstream.kernels.decode_attention import choose_num_splits
            mc = self.model.config
            ctx = max(512, 1 << (max_len - 1).bit_length())
            self.batch.decode_splits = choose_num_splits(
                1, mc.num_key_value_heads, ctx, max_query_len=t,
                group=mc.num_attention_heads // mc.num_key_value_heads)

    # ---- one generation --------------------------------------------------------------

    @torch.inference_mode()
    def generate(self, prompt: list[int], max_tokens: int, done=None, params=None) -> list[int]:
        """Greedy continuation of `prompt`, max_tokens long, or shorter when
        `done(new_tokens)` (called with each batch of new tokens) returns True;
        the tokens past that point are not returned. `accepted` lists the
        drafts accepted per round. params: the request's, greedy (or None)."""
        if params is not None and not params.is_greedy:
            raise ValueError("eagle loop: greedy requests only (sampled ones take the engine's path)")
        d1 = self.depth + 1
        if len(prompt) + max_tokens > self.max_len:
            raise ValueError(f"eagle loop: prompt + max_tokens must be <= max_len={self.max_len}")
        t0 = time.perf_counter()
        blocks = self.block_pool.allocate(self.nblocks)
        try:
            ids = torch.tensor([b.block_id for b in blocks], dtype=torch.int32)
            self._use_blocks(ids)
            out = [self._prefill(prompt)]                  # ends on a sync (the first token)
            t1 = time.perf_counter()
            self.accepted = []
            stop = done is not None and done(out)
            while len(out) < max_tokens and not stop:
                # Each round emits 1 .. D + 1 tokens: this many cannot pass max_tokens.
                n = max(1, (max_tokens - len(out)) // d1)
                self.rix.zero_()
                for _ in range(n):
                    self._step()
                ring = self.ring[:n].cpu()
                new = []
                for row in ring.tolist():
                    new.extend(row[1:1 + row[0]])
                    self.accepted.append(row[0] - 1)
                out.extend(new)
                self.rounds += n
                self.batches += 1
                self.emitted += len(new)
                stop = done is not None and done(new)
            self.seconds["prefill"] += t1 - t0
            self.seconds["rounds"] += time.perf_counter() - t1
            return out[:max_tokens]
        finally:
            self.block_pool.free(blocks[::-1])

    def _use_blocks(self, ids: torch.Tensor) -> None:
        """ids: [nblocks] int32 block ids; fills the block table and the slot of
        every position (one gather per lookup in the round)."""
        self.block_table[0].copy_(ids)
        slots = self.block_table[0].long()[:, None] * self.bs + torch.arange(self.bs, device=self.dev)
        self.slot_of.copy_(slots.flatten())

    def _slots(self, pos: torch.Tensor) -> torch.Tensor:
        return self.slot_of[pos]

    def _compiled(self, fn, plain):
        """fn (compiled), or `plain` once any compiled part has failed."""
        def run(*args):
            if self.compile_error is None:
                try:
                    return fn(*args)
                except Exception as e:   # noqa: BLE001 - the plain functions stay correct
                    import warnings
                    warnings.warn(f"eagle loop: a compiled part failed: {e!r}")
                    self.compile_error = repr(e)[:300]
            return plain(*args)
        return run

    # ---- the round -------------------------------------------------------------------

    def _step(self) -> None:
        if not self.graphs:
            self.round()
            return
        if self.graph is None:
            state = (self.n_ctx, self.root, self.feat, self.hvalid, self.hptr, self.table,
                     self.rix)
            saved = [x.clone() for x in state]
            try:
                self._capture()
            except Exception as e:   # noqa: BLE001 - the eager round stays correct
                import warnings
                warnings.warn(f"eagle loop: CUDA graph capture failed, rounds run eagerly: {e!r}")
                self.graph_error = repr(e)[:300]
                self.graphs = False
                torch.cuda.synchronize()
                for x, y in zip(state, saved):
                    x.copy_(y)
                self.round()
                return
        self.graph.replay()

    def _capture(self) -> None:
        state = (self.n_ctx, self.root, self.feat, self.hvalid, self.hptr, self.table, self.rix)
        saved = [x.clone() for x in state]
        self.round()                                   # compiles kernels; results checked below
        eager = (self.ring[0].clone(), self.table.clone())
        for x, y in zip(state, saved):
            x.copy_(y)
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.round()                               # warm-up on a side stream, as torch asks
        torch.cuda.current_stream().wait_stream(stream)
        for x, y in zip(state, saved):
            x.copy_(y)
        with torch.cuda.graph(graph):
            self.round()
        for x, y in zip(state, saved):
            x.copy_(y)
        graph.replay()
        # Reported, not fatal: kernels may round differently inside a graph (near-ties);
        # the benchmark checks the outputs against plain decoding anyway.
        self.graph_matches = bool(torch.equal(self.ring[0], eager[0]) and torch.equal(
            self.table[[0, 2, 3]], eager[1][[0, 2, 3]]))
        if not self.graph_matches:
            import warnings
            warnings.warn("eagle loop: the replayed round differs from the eager one")
        for x, y in zip(state, saved):   # the check's round again, now by the graph
            x.copy_(y)
        self.graph = graph

    def round(self) -> None:
        """One round on the device (no host value read; shapes fixed)."""
        t, n = self.nodes + 1, self.n_ctx
        # 1. The tree from the last expansion's candidates.
        tokens, prow, depth, anc = self._tree_fn(self.table, self.root)
        # 2. The target over root + tree.
        b = self.batch
        self._feed_fn(tokens, depth, anc, n, b.input_ids, b.positions, b.slot_mapping,
                      b.context_lens, b.seq_lens, b.tree_bits)
        if not self._bits_only:          # a backend that reads the mask itself
            b.tree_mask.copy_(anc[None])
        if self.dev.type != "cuda":      # the CPU kernels size their loops from host lengths
            b.max_seq_len = int(n) + t
            b.seq_lens_cpu = [b.max_seq_len]
        self.backend.prepare(b)
        hidden = self.model(b)                                         # [t, hidden]
        # torch's argmax, one block a row: 61 rows fill the GPU, where row_argmax's two
        # passes took 16 us and logp_topk's pieces (k = 1) made the round 1.346 ms against
        # 1.332 (H200, dummy weights, same process)
        logits = self.model.compute_logits(hidden, fp32=False)
        am = logits.argmax(-1)                                           # [t]
        # 3. Greedy acceptance, K/V of the accepted path after the root.
        a, last, path, emitted, src, dst = self._accept_fn(tokens, am, prow, depth, anc, n)
        for pool in self.pools:
            if pool is not None:
                move_rows(pool, src, dst)
        # 4. The head over the new pairs; the state for the next round, the ring entry
        #    (accepted + 1, then the tokens); the next tree's candidates.
        feat, k, v, valid = self._pairs_fn(hidden, path, emitted, a, n, self.hk, self.hv,
                                           self.hvalid)
        self._commit_fn(a, last, am, emitted, feat, k, v, valid, self.hk, self.hv, self.hvalid,
                        self.hptr, self.feat, self.root, n, self.ring, self.rix)
        self.table.copy_(self._levels(self.feat, self.hk, self.hv, self.hvalid, n))

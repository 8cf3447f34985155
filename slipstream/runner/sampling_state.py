"""Persistent sampling parameters by row, gathered into a `SamplingBatch` each step.

Parameters live in host arrays indexed by the request's row (written once, when
the request arrives). A step gathers the rows that sample with numpy, packs
them into a pinned staging buffer and copies it to the device in one
non-blocking copy: no Python loop over requests, no blocking copy.

Penalties keep per-row state on the device: output token counts
[rows, vocab] int32 and a prompt-token mask [rows, vocab] bool, allocated when
the first request with penalties arrives, set once per request and updated
with each step's sampled tokens on the device (no recount of the history).
"""
from __future__ import annotations

import numpy as np
import torch

from slipstream.layers.sampler import Penalties, SamplingBatch, make_generator
from slipstream.sampling_params import SAMPLING_EPS, SamplingParams

# Float rows of the staging buffer.
_TEMP, _TOP_P, _MIN_P, _REP, _FREQ, _PRES = range(6)
_NO_LOGPROBS = -2


class SamplingState:
    def __init__(self, max_rows: int, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.device = device
        n = max_rows
        self.f32 = np.zeros((6, n), dtype=np.float32)   # per-row float parameters
        self.top_k = np.full(n, vocab_size, dtype=np.int64)
        self.min_tokens = np.zeros(n, dtype=np.int64)
        self.num_outputs = np.zeros(n, dtype=np.int64)  # output tokens so far (incl. in flight)
        self.num_logprobs = np.full(n, _NO_LOGPROBS, dtype=np.int64)
        self.has_penalties = np.zeros(n, dtype=bool)
        self.min_token_ids: list[tuple[int, ...]] = [()] * n  # masked below min_tokens
        self.logit_bias: list[tuple[tuple[int, ...], tuple[float, ...]] | None] = [None] * n
        self.generators: list[torch.Generator | None] = [None] * n
        self.output_counts: torch.Tensor | None = None   # [rows, vocab] int32
        self.prompt_mask: torch.Tensor | None = None     # [rows, vocab] bool
        pin = device.type == "cuda"
        # Staging: 6 float rows | bias values, and int64 top_k | rows | mask pairs | bias pairs.
        self._max_mask = 64 * n
        self._stage = [(torch.zeros(6 * n + self._max_mask, dtype=torch.float32, pin_memory=pin),
                        torch.zeros(2 * n + 4 * self._max_mask, dtype=torch.int64, pin_memory=pin),
                        torch.cuda.Event() if pin else None) for _ in range(2)]
        self._flip = 0
        # The last batch built, reused while the same rows sample again with nothing
        # added or removed and nothing step-dependent in it (penalty counts, min_tokens
        # masks): (rows' bytes, version, batch). A decode step of an unchanged batch
        # then costs a dictionary lookup instead of the gathers and the copy.
        self._version = 0
        self._last: tuple[bytes, int, SamplingBatch] | None = None

    def add(self, row: int, params: SamplingParams, prompt: list[int], outputs: list[int],
            eos_token_ids: tuple[int, ...], generator: torch.Generator | None = None) -> None:
        """`generator`: the request's own stream when it comes back after a
        preemption (its draws continue where they stopped)."""
        self._version += 1
        f = self.f32[:, row]
        f[_TEMP], f[_TOP_P], f[_MIN_P] = params.temperature, params.top_p, params.min_p
        f[_REP], f[_FREQ], f[_PRES] = (params.repetition_penalty, params.frequency_penalty,
                                       params.presence_penalty)
        k = params.top_k
        self.top_k[row] = min(k, self.vocab_size) if k > 0 else self.vocab_size
        self.min_tokens[row] = params.min_tokens
        self.num_outputs[row] = len(outputs)
        self.num_logprobs[row] = _NO_LOGPROBS if params.logprobs is None else params.logprobs
        stops = dict.fromkeys([*(params.stop_token_ids or ()), *eos_token_ids])
        self.min_token_ids[row] = tuple(t for t in stops if t < self.vocab_size)
        self.generators[row] = generator or make_generator(params, self.device)
        bias = {t: v for t, v in (params.logit_bias or {}).items() if t < self.vocab_size}
        self.logit_bias[row] = (tuple(bias), tuple(bias.values())) if bias else None
        self.has_penalties[row] = params.has_penalties
        if params.has_penalties:
            self._init_penalty_row(row, prompt, outputs)

    def _init_penalty_row(self, row: int, prompt: list[int], outputs: list[int]) -> None:
        if self.output_counts is None:
            n = self.f32.shape[1]
            self.output_counts = torch.zeros(n, self.vocab_size, dtype=torch.int32, device=self.device)
            self.prompt_mask = torch.zeros(n, self.vocab_size, dtype=torch.bool, device=self.device)
        pin = self.device.type == "cuda"
        ids = torch.tensor(prompt + outputs, dtype=torch.int64, pin_memory=pin)
        ids = ids.to(self.device, non_blocking=True)
        self.prompt_mask[row].zero_()
        self.prompt_mask[row].index_fill_(0, ids[:len(prompt)], True)
        self.output_counts[row].zero_()
        out = ids[len(prompt):]
        self.output_counts[row].index_add_(0, out, torch.ones_like(out, dtype=torch.int32))

    def remove(self, row: int) -> None:
        self._version += 1
        self.generators[row] = None

    def build(self, rows: np.ndarray) -> SamplingBatch:
        """The SamplingBatch of the requests at `rows` (batch order), one copy to the
        device (or the last one built, where it still holds)."""
        key = np.ascontiguousarray(rows).tobytes()
        last = self._last
        if last is not None and last[0] == key and last[1] == self._version:
            return last[2]
        sb = self._build(rows)
        static = not self.has_penalties[rows].any() and not (self.min_tokens[rows] > 0).any()
        self._last = (key, self._version, sb) if static else None
        return sb

    def _build(self, rows: np.ndarray) -> SamplingBatch:
        n = len(rows)
        f = self.f32[:, rows]
        temp = f[_TEMP]
        greedy = temp < SAMPLING_EPS
        ks = self.top_k[rows]
        use_top_k = bool((ks < self.vocab_size).any())
        use_top_p = bool((f[_TOP_P] < 1.0).any())
        use_min_p = bool((f[_MIN_P] > 0.0).any())
        pen = self.has_penalties[rows]
        short = np.flatnonzero(self.num_outputs[rows] < self.min_tokens[rows])
        mask_rows = [i for i in short for _ in self.min_token_ids[rows[i]]]
        mask_ids = [t for i in short for t in self.min_token_ids[rows[i]]]
        bias_rows = [i for i, r in enumerate(rows) if self.logit_bias[r] is not None]
        b_rows = [i for i in bias_rows for _ in self.logit_bias[rows[i]][0]]
        b_ids = [t for i in bias_rows for t in self.logit_bias[rows[i]][0]]
        b_vals = [v for i in bias_rows for v in self.logit_bias[rows[i]][1]]
        nl = self.num_logprobs[rows]
        nl = nl[nl != _NO_LOGPROBS]
        widths = np.where(nl == -1, self.vocab_size, np.minimum(nl, self.vocab_size))

        self._flip ^= 1
        hf, hi, event = self._stage[self._flip]
        if event is not None:
            event.synchronize()
        m, nb = len(mask_ids), len(b_ids)
        if m > self._max_mask or nb > self._max_mask:
            raise ValueError("too many min_tokens stop ids or logit_bias entries in one step")
        hf.numpy()[:6 * n] = f.reshape(-1)
        hf.numpy()[6 * n:6 * n + nb] = b_vals
        hn = hi.numpy()
        hn[:n] = ks
        hn[n:2 * n] = rows
        hn[2 * n:2 * n + m] = mask_rows
        hn[2 * n + m:2 * n + 2 * m] = mask_ids
        o = 2 * n + 2 * m
        hn[o:o + nb] = b_rows
        hn[o + nb:o + 2 * nb] = b_ids
        if self.device.type == "cuda":
            dfull = hf[:6 * n + nb].to(self.device, non_blocking=True)
            di = hi[:o + 2 * nb].to(self.device, non_blocking=True)
            event.record()
        else:
            dfull, di = hf[:6 * n + nb].clone(), hi[:o + 2 * nb].clone()
        df = dfull[:6 * n].view(6, n)
        rows_dev = di[n:2 * n]

        penalties = None
        if pen.any():
            penalties = Penalties(
                repetition=df[_REP], frequency=df[_FREQ], presence=df[_PRES],
                output_counts=self.output_counts.index_select(0, rows_dev),
                prompt_mask=self.prompt_mask.index_select(0, rows_dev))
        gens = {i: self.generators[r] for i, r in enumerate(rows)
                if self.generators[r] is not None and not greedy[i]}
        return SamplingBatch(
            num_rows=n,
            all_greedy=bool(greedy.all()),
            all_random=not greedy.any(),
            temperature=None if greedy.all() else df[_TEMP],
            top_k=di[:n] if use_top_k else None,
            max_top_k=int(ks[ks < self.vocab_size].max()) if use_top_k else self.vocab_size,
            top_p=df[_TOP_P] if use_top_p else None,
            min_p=df[_MIN_P] if use_min_p else None,
            generators=gens,
            penalties=penalties,
            min_tokens_mask=(di[2 * n:2 * n + m], di[2 * n + m:o]) if m else None,
            logit_bias=(di[o:o + nb], di[o + nb:], dfull[6 * n:]) if nb else None,
            max_num_logprobs=int(widths.max()) if len(widths) else None,
            rows=rows_dev,
        )

    def record_sampled(self, batch: SamplingBatch, rows: np.ndarray, sampled: torch.Tensor) -> None:
        """After sampling: count the new tokens (host counters and, for penalties,
        the device counts). sampled: [num_rows] int64 on the device."""
        self.num_outputs[rows] += 1
        if self.output_counts is not None and self.has_penalties[rows].any():
            self.output_counts.index_put_((batch.rows, sampled),
                                          torch.ones_like(sampled, dtype=torch.int32), accumulate=True)

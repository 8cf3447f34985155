"""When speculation pays: the auto-off rule, fed with measurements.

A round at batch B pays when

    tau * plain(B)  >  spec(B) + draft_per_request * B

with tau the measured tokens per request per round, plain(B) the measured
time of a plain decode step, spec(B) that of a step verifying every
request's drafts, and the drafting cost charged per request (proposers
that draft request by request, like EAGLE, cost that; batched ones cost
less, so the rule errs towards plain decoding). Every term is measured in the
engine as it runs (steps are timed per batch-size bucket, powers of two), so
the rule sees what the roofline cannot: a verification step that runs
eagerly while plain decode replays a CUDA graph, or CPU kernels whose cost
grows with the tokens of a step. Where a bucket has no measurement yet, the
analysis layer's roofline (`analysis.specdec`: critical batch Bc of the model
on its hardware) scales the nearest measured one; with nothing measured at
all, the roofline rule alone decides (`round_speedup`).

While speculation is on, every `plain_every`-th step runs plainly to keep
plain(B) measured; while it is off, every `probe_every`-th step (or rarer,
keeping probes under 2% of the time at batch 1 and 0.5% above) drafts for at
most `probe_requests` requests so tau keeps being measured at little cost;
above batch 1 no probes run where even rounds accepting every draft
(tau = k + 1) would not pay. A probe at batch > 1
shares its step with plain decodes, which then runs without a CUDA graph
and breaks the overlap of steps: its cost is measured (`probe_time`), and
until it is, assumed to be 4 plain steps (a first probe after ~200 steps).
Chains also get their length from the roofline (best_gamma_at_batch with
alpha inferred from tau).
"""
from __future__ import annotations

import torch

from slipstream.analysis import specdec
from slipstream.analysis.hardware import GPUS, HardwareProfile

# A CPU with no measured profile: ~50 GB/s and ~1 TFLOP/s, Bc ~ 20 for bf16 weights.
CPU_DEFAULT = HardwareProfile("cpu-default", 50e9, 1e12, source="assumed")
# On a CPU the roofline's Bc does not describe a step: the one-call decoder's
# products (int8 dot instructions) and attention cost a share of a one-token
# step per extra token from the first, well below Bc (measured on the default
# model, Q4_1, 2 AVX-512 threads: ~0.2 of a step a token, one thread's CPU
# time). A CPU step over n tokens a request is costed 1 + CPU_TOKEN_COST * (n - 1)
# plain steps until the steps are measured, and a chain's length is chosen
# with the measured cost of a verified token added to the draft cost.
CPU_TOKEN_COST = 0.2
# Quiet steps between re-readings of the rule while only plain-step timings change.
QUIET_RECHECK = 64


def hardware_for(device: torch.device) -> HardwareProfile:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device).upper()
        for key, hw in GPUS.items():
            if key in name:
                return hw
        return GPUS["H100"]
    return CPU_DEFAULT


def bucket(batch: int) -> int:
    return 1 << max(int(batch) - 1, 0).bit_length()


class SpecGovernor:
    def __init__(self, spec, model_config, device: torch.device, probe_every: int = 64,
                 plain_every: int = 64, probe_requests: int = 1, decay: float = 0.9):
        self.spec = spec
        self.k = spec.num_speculative_tokens
        self.auto_off = spec.auto_off
        self.chain = spec.method in ("draft", "ngram", "peagle")
        self.critical_batch = specdec.critical_batch_for(model_config, hardware_for(device))
        self.cpu = device.type == "cpu"
        self.probe_every, self.plain_every = probe_every, plain_every
        self.probe_requests, self.decay = probe_requests, decay
        self.tau: float | None = None            # tokens per request per round (EMA)
        self.verify_tokens: float | None = None  # rows verified per request (EMA)
        self.draft_per_request: float | None = None   # seconds (EMA)
        self.plain_time: dict[int, float] = {}   # bucket -> seconds per plain decode step
        self.spec_time: dict[int, float] = {}    # bucket -> seconds per all-verifying step
        self.probe_time: dict[int, float] = {}   # bucket -> seconds per partly verifying step
        self._off_steps = 0
        self._on_steps = 0
        self.last_k = self.k
        self.request_limit: int | None = None    # requests to draft for this step (probes)
        self.quiet = False                       # off with no probes at the last batch asked
        # The rule's inputs when it last said quiet: until one of them or the batch
        # changes, the answer stands (asked every step; nothing else runs then). A
        # quiet step's own timing (a plain step) moves an average the answer hardly
        # depends on: it is read again after QUIET_RECHECK quiet steps.
        self._stamp = 0                          # counts measurements other than plain steps
        self._quiet_key: tuple | None = None
        self._quiet_steps = 0

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else self.decay * old + (1 - self.decay) * new

    # ---- measurements --------------------------------------------------------

    def observe_round(self, emitted: int, requests: int, drafted: int) -> None:
        self._stamp += 1
        self.tau = self._ema(self.tau, emitted / requests)
        self.verify_tokens = self._ema(self.verify_tokens, 1 + drafted / requests)

    def observe_draft(self, seconds: float, requests: int = 1) -> None:
        self._stamp += 1
        self.draft_per_request = self._ema(self.draft_per_request, seconds / max(requests, 1))

    def observe_step(self, seconds: float, batch: int, kind: str | None) -> None:
        """kind: 'plain' (every request decoded one token), 'spec' (every
        request verified drafts), 'probe' (some did) or None (prefill: not
        recorded)."""
        table = {"plain": self.plain_time, "spec": self.spec_time,
                 "probe": self.probe_time}.get(kind)
        if table is not None:
            if kind != "plain":
                self._stamp += 1
            b = bucket(batch)
            table[b] = self._ema(table.get(b), seconds)

    # ---- the rule ----------------------------------------------------------------

    def _scaled(self, table: dict[int, float], batch: int, tokens: float) -> float | None:
        """The measured time at batch's bucket, else the nearest measured bucket's
        scaled by the roofline (max(1, B * tokens / Bc))."""
        b = bucket(batch)
        if b in table:
            return table[b]
        if not table:
            return None
        near = min(table, key=lambda x: abs(x.bit_length() - b.bit_length()))
        return table[near] * self._cost(batch, tokens) / self._cost(near, tokens)

    def _cost(self, batch: float, tokens: float) -> float:
        """A step's modelled cost, batch requests x tokens each (relative units):
        the roofline's max(1, B * tokens / Bc), on a CPU 1 + r * (B * tokens - 1) with r
        a token's cost at batch 1 (measured, else CPU_TOKEN_COST)."""
        if self.cpu:
            return 1.0 + self._token_cost(1) * (batch * tokens - 1)
        return max(1.0, batch * tokens / self.critical_batch)

    def _token_cost(self, batch: int) -> float:
        """CPU: a verified token's cost in plain steps, measured where both steps are."""
        b = bucket(batch)
        plain, spec, vt = self.plain_time.get(b), self.spec_time.get(b), self.verify_tokens
        if plain and spec and vt and vt > 1.05:
            return max(spec / plain - 1.0, 0.0) / (batch * (vt - 1))
        return CPU_TOKEN_COST

    def predicted_speedup(self, batch: int) -> float | None:
        if None in (self.tau, self.verify_tokens, self.draft_per_request):
            return None
        vt = self.verify_tokens
        plain = self._scaled(self.plain_time, batch, 1.0)
        spec = self._scaled(self.spec_time, batch, vt)
        if plain is None and spec is None:
            return None
        roof = self._cost(batch, vt) / self._cost(batch, 1.0)   # spec step / plain step
        plain = plain if plain is not None else spec / roof
        spec = spec if spec is not None else plain * roof
        return self.tau * plain / (spec + self.draft_per_request * batch)

    def _probe_interval(self, batch: int) -> int:
        """Steps between probes: `probe_every`, or more where a probe (one
        request's verification and drafting) costs more than 2% of that many
        plain steps (on a CPU a 16-node verification costs several steps)."""
        plain = self._scaled(self.plain_time, batch, 1.0)
        if not plain:
            return self.probe_every
        draft = self.draft_per_request or 0.0
        probe = self.probe_time.get(bucket(batch))
        if probe is not None:
            extra = max(probe - plain, 0.0) + draft
        elif batch > 1:
            extra = 4 * plain
        else:
            one_spec = self.spec_time.get(1)
            if one_spec is None:
                return self.probe_every
            extra = max(one_spec - plain, 0.0) + draft
        # Probes may take 2% of the time at batch 1 (a probe is a round), 0.5% above it.
        budget = 50 if batch <= 1 else 200
        return max(self.probe_every, int(budget * extra / plain) + 1)

    def _key(self, batch: int) -> tuple:
        """What a quiet answer at `batch` was computed from."""
        return (batch, self._stamp, self.tau, self.verify_tokens, self.draft_per_request,
                self.critical_batch, self.k)

    def num_tokens(self, batch: int) -> int:
        """Draft budget per request for the next step (0: do not speculate);
        sets `request_limit` for probe rounds. Call once per step."""
        self.request_limit = None
        self.quiet = False
        if not self.auto_off:
            return self.k
        if self._quiet_key is not None and self._quiet_key == self._key(batch):
            self._quiet_steps += 1
            if self._quiet_steps < QUIET_RECHECK:
                self._off_steps += 1
                self.last_k, self.quiet = 0, True
                return 0
        self._quiet_key, self._quiet_steps = None, 0
        s = self.predicted_speedup(batch)
        if s is None:            # nothing measured yet: try
            return self.k
        if s <= 1.0:
            self._off_steps += 1
            # Above batch 1, where even rounds accepting every draft would not pay, tau
            # need not be measured there (batch 1 keeps probing: its probes re-measure
            # the verification step, whose first timing may include a graph capture).
            if batch > 1 and s * (self.k + 1) / max(self.tau, 1.0) <= 1.0:
                self.last_k, self.quiet = 0, True
                self._quiet_key = self._key(batch)
                return 0
            if self._off_steps % self._probe_interval(batch):
                self.last_k = 0
                return 0
            self.request_limit = self.probe_requests   # a probe keeps tau measured
            return self.k
        self._off_steps = 0
        self._on_steps += 1
        if bucket(batch) not in self.plain_time or self._on_steps % self.plain_every == 0:
            self.last_k = 0      # a plain step keeps plain(B) measured
            return 0
        k = self.k
        if self.chain and self.last_k:
            gamma = max(1, round(self.verify_tokens - 1))
            tau = min(max(self.tau, 1.0), gamma + 1.0)
            alpha = specdec.alpha_from_tau(tau, gamma)
            plain = self._scaled(self.plain_time, batch, 1.0)
            c = self.draft_per_request * batch / plain / max(gamma, 1)
            if self.cpu:         # each drafted token also costs its share of the verify step
                k = max(1, specdec.best_gamma(alpha, c + self._token_cost(batch), self.k))
            else:
                k = max(1, specdec.best_gamma_at_batch(alpha, c, batch, self.critical_batch, self.k))
        self.last_k = k
        return k

"""When speculation pays: the auto-off rule, fed with measurements.

The analysis layer's roofline model (`analysis.specdec.round_speedup`) gives
the speedup of a round from the measured tokens per round (tau), the tokens
verified per request, the draft cost in units of a memory-bound target step,
the batch size and the critical batch Bc of the device (from the roofline of
the model on its hardware profile). Drafts are asked for only while the
predicted speedup at the current batch size exceeds 1; while off, every
`probe_every`-th step still drafts so tau keeps being measured. Chains also
get their length from the rule (best_gamma_at_batch with alpha inferred from
tau).
"""
from __future__ import annotations

import torch

from slipstream.analysis import specdec
from slipstream.analysis.hardware import GPUS, HardwareProfile

# A CPU with no measured profile: ~50 GB/s and ~1 TFLOP/s, Bc ~ 20 for bf16 weights.
CPU_DEFAULT = HardwareProfile("cpu-default", 50e9, 1e12, source="assumed")


def hardware_for(device: torch.device) -> HardwareProfile:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device).upper()
        for key, hw in GPUS.items():
            if key in name:
                return hw
        return GPUS["H100"]
    return CPU_DEFAULT


class SpecGovernor:
    def __init__(self, spec, model_config, device: torch.device, probe_every: int = 16,
                 decay: float = 0.9):
        self.spec = spec
        self.k = spec.num_speculative_tokens
        self.auto_off = spec.auto_off
        self.chain = spec.method in ("draft", "ngram")
        self.critical_batch = specdec.critical_batch_for(model_config, hardware_for(device))
        self.probe_every, self.decay = probe_every, decay
        self.tau: float | None = None          # tokens per request per round (EMA)
        self.verify_tokens: float | None = None
        self.draft_time: float | None = None   # seconds per propose call (EMA)
        self.step_time: float | None = None    # seconds per target step (EMA)
        self._off_steps = 0
        self.last_k = self.k

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else self.decay * old + (1 - self.decay) * new

    def observe_round(self, emitted: int, requests: int, drafted: int) -> None:
        self.tau = self._ema(self.tau, emitted / requests)
        self.verify_tokens = self._ema(self.verify_tokens, 1 + drafted / requests)

    def observe_draft(self, seconds: float) -> None:
        self.draft_time = self._ema(self.draft_time, seconds)

    def observe_step(self, seconds: float) -> None:
        self.step_time = self._ema(self.step_time, seconds)

    def predicted_speedup(self, batch: int) -> float | None:
        if None in (self.tau, self.verify_tokens, self.draft_time, self.step_time):
            return None
        bc = self.critical_batch
        # The measured step ran at roughly max(1, B vt / Bc) memory-bound step units.
        unit = self.step_time / max(1.0, batch * self.verify_tokens / bc)
        return specdec.round_speedup(self.tau, self.verify_tokens, self.draft_time / unit,
                                     batch, bc)

    def num_tokens(self, batch: int) -> int:
        """Draft budget per request for the next step (0: do not speculate)."""
        if not self.auto_off:
            return self.k
        s = self.predicted_speedup(batch)
        if s is None:            # nothing measured yet: try
            return self.k
        if s <= 1.0:
            self._off_steps += 1
            if self._off_steps % self.probe_every:
                self.last_k = 0
                return 0
            return self.k        # a probe round keeps tau measured
        self._off_steps = 0
        k = self.k
        if self.chain and self.last_k:
            gamma = max(1, round(self.verify_tokens - 1))
            tau = min(max(self.tau, 1.0), gamma + 1.0)
            alpha = specdec.alpha_from_tau(tau, gamma)
            bc = self.critical_batch
            unit = self.step_time / max(1.0, batch * self.verify_tokens / bc)
            c = self.draft_time / unit / max(gamma, 1)
            k = max(1, specdec.best_gamma_at_batch(alpha, c, batch, bc, self.k))
        self.last_k = k
        return k

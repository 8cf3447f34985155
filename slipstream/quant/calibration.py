"""Calibration: text -> token windows -> the inputs every linear layer sees, layer by layer.

`CalibrationModel` holds a dense fp32 copy of the model on the CPU (or a given device)
and runs it one decoder layer at a time over all calibration windows, so a method can
quantize layer i from the inputs it receives when layers 0..i-1 are already quantized
(GPTQ's sequential scheme). Forward pre-hooks on the linear layers hand each layer's
input x [tokens, in] to an `InputStats`, which keeps only running statistics (the
Hessian 2 X^T X / n, mean |x_j|, max |x_j|) and a bounded sample of rows.
"""
from __future__ import annotations

import copy
from importlib import resources
from pathlib import Path

import torch
from torch import nn

from slipstream.attention.selector import create_backend
from slipstream.batch import ForwardBatch
from slipstream.layers.linear import LinearBase
from slipstream.models.llama import LlamaForCausalLM


# The calibration set that ships with slipstream (data/README.md): prose written for it,
# then text sampled from the default model over a broad set of prompts
# (benchmarks/quant/make_calibration.py), about 28,000 tokens together.
DEFAULT_CALIBRATION_FILES = ("data/calibration.txt", "data/calibration_generated.txt")


def default_calibration_text() -> str:
    """The calibration text that ships with slipstream."""
    root = resources.files("slipstream.quant")
    return "\n\n".join(root.joinpath(f).read_text("utf-8") for f in DEFAULT_CALIBRATION_FILES)


def token_windows(tokenizer, text: str, seq_len: int, max_windows: int) -> list[list[int]]:
    """Windows of `seq_len` consecutive tokens (the last one may be shorter, >= seq_len / 2);
    with more than `max_windows`, that many spread evenly over the text."""
    if seq_len < 2:
        raise ValueError(f"seq_len: expected at least 2, got {seq_len}")
    if max_windows < 1:
        raise ValueError(f"num_windows: expected at least 1, got {max_windows}")
    ids = tokenizer.encode(text)
    windows = [ids[i:i + seq_len] for i in range(0, len(ids), seq_len)]
    windows = [w for w in windows if len(w) >= max(2, seq_len // 2)]
    if not windows:
        raise ValueError(f"calibration text: {len(ids)} tokens, too short for one window")
    if len(windows) > max_windows:   # spread over the whole text, not only its beginning
        step = len(windows) / max_windows
        windows = [windows[int(i * step)] for i in range(max_windows)]
    return windows


class _StopForward(Exception):
    """Raised by a statistics hook to end a forward whose remaining layers are not needed."""


class InputStats:
    """Running statistics of one linear layer's inputs x [tokens, in]."""

    def __init__(self, in_features: int, hessian: bool = True, max_rows: int = 2048,
                 row_stride: int = 4):
        self.n = 0
        self.h = torch.zeros(in_features, in_features, dtype=torch.float64) if hessian else None
        self.abs_sum = torch.zeros(in_features, dtype=torch.float64)
        self.abs_max = torch.zeros(in_features)
        self.rows: list[torch.Tensor] = []
        self.max_rows, self.row_stride = max_rows, row_stride

    # Asymmetric calibration (GPTQ's target W X_ref instead of W X, see gptq.py): the inputs
    # the unquantized model gives the layer, one tensor per call in the order of the calls
    # (an InputRecorder's `inputs`); add() then also sums 2 (x_ref - x)^T x.
    reference = None
    dxx = None

    def add(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).float().cpu()
        if self.h is not None:   # fp32 products per call, summed in fp64 across calls
            self.h += (2.0 * x.t() @ x).double()
        if self.reference is not None:
            ref = self.reference.pop(0)
            if ref.shape != x.shape:
                raise ValueError(f"reference inputs: shape {tuple(ref.shape)} for inputs "
                                 f"{tuple(x.shape)}")
            d = (2.0 * (ref - x).t() @ x).double()
            self.dxx = d if self.dxx is None else self.dxx + d
        self.abs_sum += x.abs().sum(0).double()
        self.abs_max = torch.maximum(self.abs_max, x.abs().amax(0))
        have = sum(r.shape[0] for r in self.rows)
        if have < self.max_rows:
            # Every row_stride-th row of each window (the quantizer: every 4th, or sparser
            # for more than 4 x max_rows tokens), so the sample spreads over all windows
            # (and over positions), not only the first ones.
            self.rows.append(x[::self.row_stride][:self.max_rows - have].clone())
        self.n += x.shape[0]

    @property
    def hessian(self) -> torch.Tensor:
        return (self.h / max(self.n, 1)).float()

    @property
    def abs_mean(self) -> torch.Tensor:
        return (self.abs_sum / max(self.n, 1)).float()

    @property
    def sample(self) -> torch.Tensor:
        return torch.cat(self.rows)

    @property
    def cross(self) -> torch.Tensor | None:
        """2/n sum (x_ref - x)^T x over the calls, [in, in] (with `reference` set)."""
        return None if self.dxx is None else (self.dxx / max(self.n, 1)).float()


class InputRecorder:
    """Keeps every input a linear layer receives (one tensor [tokens, in] per call)."""

    def __init__(self):
        self.inputs: list[torch.Tensor] = []

    def add(self, x: torch.Tensor) -> None:
        self.inputs.append(x.detach().reshape(-1, x.shape[-1]).float().cpu().clone())


class CalibrationModel:
    def __init__(self, files, device: str | torch.device = "cpu"):
        self.config = files.config
        self.device = torch.device(device)
        with torch.device(self.device):
            self.model = LlamaForCausalLM(self.config, create_backend("torch", self.device))
        self.model.load_weights(files.weights())
        self.model.eval()
        mc = self.config
        self._cache_shape = (mc.num_key_value_heads, mc.head_dim)

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.model.layers

    def linear_layers(self, i: int, layer: nn.Module | None = None) -> dict[str, LinearBase]:
        """Module name (as QuantMethodFor sees it) -> linear layer of decoder layer i (or of
        `layer`, a copy of it)."""
        prefix = f"model.layers.{i}"
        layer = self.layers[i] if layer is None else layer
        return {f"{prefix}.{name}": m for name, m in layer.named_modules()
                if isinstance(m, LinearBase)}

    def copy_layer(self, i: int) -> nn.Module:
        """A copy of decoder layer i (its weights as they are now) that run_layer can run;
        it shares the model's attention backend."""
        backend = self.model.backend
        return copy.deepcopy(self.layers[i], memo={id(backend): backend})

    def _batch(self, n: int) -> ForwardBatch:
        d = self.device
        return ForwardBatch(
            input_ids=torch.zeros(n, dtype=torch.int64, device=d),
            positions=torch.arange(n, device=d),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=d),
            seq_lens=torch.tensor([n], dtype=torch.int32, device=d),
            context_lens=torch.zeros(1, dtype=torch.int32, device=d),
            slot_mapping=torch.arange(n, device=d),
            block_tables=torch.zeros(1, 1, dtype=torch.int32, device=d),
            logits_indices=torch.arange(n, device=d),
            max_query_len=n, max_seq_len=n, query_lens_cpu=[n], seq_lens_cpu=[n])

    @torch.no_grad()
    def embed(self, windows: list[list[int]]) -> list[tuple[torch.Tensor, None]]:
        """The state entering layer 0 for each window: (embeddings [n, hidden], residual None)."""
        emb = self.model.model.embed_tokens
        return [(emb(torch.tensor(w, device=self.device)), None) for w in windows]

    @torch.no_grad()
    def run_layer(self, i: int, states: list, observe: dict[str, InputStats] | None = None,
                  stop_early: bool = False, layer: nn.Module | None = None) -> list:
        """Run decoder layer i on every window's state; with `observe`, feed each named
        linear layer's inputs to its InputStats. Returns the states entering layer i + 1;
        with `stop_early`, each window's forward stops once every observed layer has seen
        its input (statistics only, e.g. for the first layers of a decoder layer), and
        nothing is returned. `layer`: run this module (a copy of layer i) instead."""
        hooks = []
        pending: set[str] = set()

        def hook(name, stats, args):
            stats.add(args[0])
            pending.discard(name)
            if stop_early and not pending:
                raise _StopForward
        layer = self.layers[i] if layer is None else layer
        for name, module in self.linear_layers(i, layer).items():
            if observe is not None and name in observe:
                hooks.append(module.register_forward_pre_hook(
                    lambda m, args, name=name, stats=observe[name]: hook(name, stats, args)))
        out = []
        try:
            for x, residual in states:
                n = x.shape[0]
                batch = self._batch(n)
                self.model.backend.prepare(batch)
                cache = torch.zeros(1, n, *self._cache_shape, dtype=x.dtype, device=self.device)
                layer.self_attn.attn.k_cache, layer.self_attn.attn.v_cache = cache, cache.clone()
                rope = self.model.model.rotary_emb.for_step(batch.positions)
                pending.update(observe or ())
                try:
                    out.append(layer(x, residual, rope, batch))
                except _StopForward:
                    pass
        finally:
            for h in hooks:
                h.remove()
            layer.self_attn.attn.k_cache = layer.self_attn.attn.v_cache = None
        return [] if stop_early else out

    @torch.no_grad()
    def logits(self, states: list) -> list[torch.Tensor]:
        """Final norm + LM head on the states after the last layer -> [n, vocab] each."""
        res = []
        for x, residual in states:
            h, _ = self.model.model.norm(x, residual)
            res.append(self.model.compute_logits(h))
        return res


def read_calibration_text(path: str | Path | None) -> str:
    if path is None:
        return default_calibration_text()
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"calib: no such file {str(p)!r}")
    return p.read_text(encoding="utf-8")

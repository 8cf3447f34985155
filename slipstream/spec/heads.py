"""Where trained draft heads live, and the LM head they draft with.

Head files: a path the user names, or the heads that ship for the default
model (made by `slipstream train-draft`, see benchmarks/spec/README.md for the
exact command and data).

Draft vocabulary (as EAGLE-3's): a head file may carry `draft_vocab` [V'],
the V' tokens most frequent in its training answers. Drafting then scores only
those rows of the target's frozen LM head (`DraftLMHead`, a dense copy of the
rows, V' x hidden), which costs V'/V of the full head; a token outside the
set is never drafted (the training log reports how many answer tokens the set
covers). Without it the full head is used.
"""
from __future__ import annotations

from pathlib import Path

import torch

SHIPPED_DIR = Path(__file__).parent / "weights"
SHIPPED = {"medusa": "smollm2-135m-instruct.medusa.safetensors",
           "eagle": "smollm2-135m-instruct.eagle.safetensors",
           "peagle": "smollm2-135m-instruct.peagle.safetensors"}


def resolve_head(path: str | None, kind: str) -> Path:
    if path is not None:
        p = Path(path).expanduser()
        if not p.is_file():
            raise ValueError(f"speculative_model: no {kind} head file at {str(p)!r}")
        _check_head_file(p, kind)
        return p
    p = SHIPPED_DIR / SHIPPED[kind]
    if not p.is_file():
        raise ValueError(f"speculative_model: no {kind} head was named and none ships "
                         f"at {p}; train one with `slipstream train-draft --method {kind}`")
    return p


def _check_head_file(p: Path, kind: str) -> None:
    """A head file names its kind in its metadata (EAGLE and P-EAGLE heads: eagle)."""
    from safetensors import safe_open

    from slipstream.errors import ModelLoadError
    want = "medusa" if kind == "medusa" else "eagle"
    try:
        with safe_open(str(p), "pt") as f:
            got = (f.metadata() or {}).get("kind")
    except Exception as e:  # noqa: BLE001 - any unreadable file: one line for the user
        raise ModelLoadError(f"speculative_model: {str(p)!r} is not a safetensors file of "
                             f"{kind} heads ({e})") from None
    if got != want:
        found = f"a {got} head file" if got else "not a head file (no 'kind' in its metadata)"
        raise ModelLoadError(f"speculative_model: {str(p)!r} is {found}, not {kind} heads; "
                             f"make them with `slipstream train-draft --method {kind}`")


def read_draft_vocab(path: str | Path) -> torch.Tensor | None:
    """The head file's draft vocabulary [V'] int64 (sorted), or None."""
    from safetensors import safe_open
    with safe_open(str(path), "pt") as f:
        return f.get_tensor("draft_vocab").long() if "draft_vocab" in f.keys() else None


def top_tokens(tokens: torch.Tensor, size: int, vocab_size: int) -> tuple[torch.Tensor, float]:
    """The `size` most frequent ids of `tokens` [N] (sorted), and the share of
    `tokens` they cover."""
    counts = torch.bincount(tokens.flatten().cpu(), minlength=vocab_size)
    size = min(size, vocab_size)
    top = counts.topk(size).indices.sort().values
    return top, counts[top].sum().item() / max(tokens.numel(), 1)


class DraftLMHead:
    """features [n, hidden] -> draft logits [n, V'] (V' = V without a draft
    vocabulary); `token_ids` maps columns back to token ids."""

    def __init__(self, target, vocab: torch.Tensor | None, dtype: torch.dtype,
                 device: torch.device | str):
        self.target = target
        self.vocab = None if vocab is None else vocab.to(device)
        self.weight = None
        if vocab is not None:
            # Rows of the target's LM head, whatever it stores (dense or quantized blocks):
            # its outputs on the identity are its weight, transposed.
            with torch.inference_mode():
                h = target.config.hidden_size
                act = dtype if dtype != torch.uint8 else torch.float32
                eye = torch.eye(h, dtype=act, device=device)
                w = target.compute_logits(eye)[:, self.vocab].T
            self.weight = w.to(dtype).contiguous().clone()            # [V', hidden]

    def __call__(self, feats: torch.Tensor) -> torch.Tensor:
        if self.weight is None:
            return self.target.compute_logits(feats)
        return feats.to(self.weight.dtype) @ self.weight.T

    def token_ids(self, cols: torch.Tensor) -> torch.Tensor:
        return cols if self.vocab is None else self.vocab[cols]

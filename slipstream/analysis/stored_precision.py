"""The precision a checkpoint stores its weights in, read off the file's tensor
table (no weight is loaded): what `slipstream analyze MODEL` assumes when no
--weight-dtype is given.

The decoder layers' tensors (norms aside) are summed in bytes and set against
the layers' linear weights the analysis counts, so scales, zeros and packing
are included, whatever the format: GGUF blocks (Q4_1 is 5 bits a weight),
GPTQ / AWQ / slipstream int4 with their group scales, fp8, bf16 or fp32. The
LM head is counted on its own (a tied head is the embedding table).
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from slipstream.analysis.precision import Precision



@dataclass(frozen=True)
class Stored:
    weight: Precision          # the decoder layers' linear weights, bits averaged
    head: Precision | None     # the LM head (None: not found)
    head_tied: bool            # the head is the embedding table
    source: str                # what was read, for the report


def stored_precision(path: str | Path, linear_params: float, head_params: float) -> Stored | None:
    """None for a preset name, a config.json alone, or a file it cannot read."""
    p = Path(path)
    try:
        if p.is_file() and p.suffix == ".gguf":
            tensors, kind = _gguf_tensors(p), "GGUF"
        elif p.is_dir() and any(p.glob("*.safetensors")):
            tensors, kind = _safetensors_tensors(p), "safetensors"
        else:
            return None
    except Exception:  # noqa: BLE001 - an unreadable table: the analysis keeps its default
        return None
    body, types = 0, Counter()
    head = embed = None
    for name, fmt, nbytes in tensors:
        if _is_layer(name) and "norm" not in name:
            body += nbytes
            types[fmt] += nbytes
        elif name.startswith(("output.", "lm_head.")):
            head = (head or 0) + nbytes
        elif name in ("token_embd.weight", "model.embed_tokens.weight"):
            embed = nbytes
    if not body or not linear_params:
        return None
    label = types.most_common(1)[0][0].lower()
    weight = Precision(label, 8 * body / linear_params)
    tied = head is None
    head_bytes = embed if tied else head
    head_prec = None if head_bytes is None or not head_params else \
        Precision("head", 8 * head_bytes / head_params)
    return Stored(weight, head_prec, tied, f"{kind} tensors, mostly {label}")


def _is_layer(name: str) -> bool:
    return name.startswith("blk.") or ".layers." in name


def _gguf_tensors(path: Path) -> list[tuple[str, str, int]]:
    from gguf import GGUFReader
    return [(t.name, t.tensor_type.name, int(t.n_bytes)) for t in GGUFReader(str(path)).tensors]


def _safetensors_tensors(folder: Path) -> list[tuple[str, str, int]]:
    """(name, dtype, bytes) from each file's JSON header (8-byte length, then the header)."""
    out = []
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            lo, hi = info["data_offsets"]
            out.append((name, info["dtype"], hi - lo))
    return out

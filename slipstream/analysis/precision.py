"""Storage precision of weights, KV cache and activations, in bytes per element.

Group-quantized formats (int4 with group size g) store one fp16 scale per g
elements, so their true cost is bits/8 + 2/g bytes: 0.515625 for int4-g128,
3% above the nominal half byte.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

_BITS = {"fp32": 32, "bf16": 16, "fp16": 16, "fp8": 8, "int8": 8, "int4": 4}
_ALIASES = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16",
            "half": "fp16", "float8": "fp8", "fp8_e4m3": "fp8", "e4m3": "fp8"}
# GPTQ/AWQ default; a bare "int4" means this group size.
_DEFAULT_GROUP = {"int4": 128}
_PATTERN = re.compile(r"^([a-z0-9_]+?)(?:[-_]?g(\d+))?$")


@dataclass(frozen=True)
class Precision:
    name: str                      # base format: fp32, bf16, fp16, fp8, int8, int4
    bits: int
    group_size: int | None = None  # elements sharing one scale; None: per-tensor/channel (negligible)
    scale_bits: int = 16           # one fp16 scale per group

    def __post_init__(self):
        if self.group_size is not None and self.group_size <= 0:
            raise ValueError(f"group size must be positive, got {self.group_size}")

    @property
    def bytes_per_element(self) -> float:
        scale = self.scale_bits / 8 / self.group_size if self.group_size else 0.0
        return self.bits / 8 + scale

    @property
    def label(self) -> str:
        return f"{self.name}-g{self.group_size}" if self.group_size else self.name


def parse_precision(text: str | Precision) -> Precision:
    """"bf16", "fp8", "int8", "int4" (group 128), "int4-g64", "int8-g128"..."""
    if isinstance(text, Precision):
        return text
    match = _PATTERN.match(text.strip().lower())
    base = _ALIASES.get(match.group(1), match.group(1)) if match else None
    if base not in _BITS:
        raise ValueError(f"unknown precision {text!r}: use one of {', '.join(_BITS)}, "
                         "optionally with a group size such as int4-g64")
    group = int(match.group(2)) if match.group(2) else _DEFAULT_GROUP.get(base)
    return Precision(base, _BITS[base], group)


BF16 = parse_precision("bf16")

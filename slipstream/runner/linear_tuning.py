"""Pick, once at start-up, the kernel each unquantized linear layer uses at
small batch: F.linear (cuBLAS) or one of the skinny-matmul configs
(kernels/skinny_gemm.py), whichever is fastest for the layer's weight shape on
this GPU. Layers of one shape share the choice; `layer.skinny` maps a row
class (1, 16) to a config, or to None for F.linear. Nothing is tuned while
serving. `SLIPSTREAM_DISABLE_SKINNY_GEMM=1` keeps F.linear everywhere.
"""
from __future__ import annotations

import logging
import os
from collections import defaultdict

import torch

from slipstream.layers.linear import LinearBase, UnquantizedLinearMethod

log = logging.getLogger(__name__)


def tune_skinny_linears(model: torch.nn.Module, max_rows: int) -> dict[str, dict]:
    """Set `layer.skinny` on every unquantized bf16/fp16 CUDA linear layer of
    `model`; returns shape -> {row class: (choice, candidate times)} for the log."""
    if os.environ.get("SLIPSTREAM_DISABLE_SKINNY_GEMM") == "1":
        return {}
    from slipstream.kernels.skinny_gemm import MAX_ROWS, tune
    groups: dict[tuple, list[LinearBase]] = defaultdict(list)
    for mod in model.modules():
        if (isinstance(mod, LinearBase) and isinstance(mod.quant_method, UnquantizedLinearMethod)
                and mod.weight.is_cuda and mod.weight.dtype in (torch.bfloat16, torch.float16)):
            groups[(tuple(mod.weight.shape), mod.weight.dtype)].append(mod)
    report = {}
    classes = [1] + ([MAX_ROWS] if max_rows > 1 else [])
    for (shape, dtype), mods in groups.items():
        choice, entry = {}, {}
        for rows in classes:
            cfg, times = tune([m.weight for m in mods], rows)
            choice[rows] = cfg
            entry[rows] = (str(cfg) if cfg else "F.linear", times)
        for m in mods:
            m.skinny = choice
        report[f"{shape[0]}x{shape[1]} ({len(mods)} layers)"] = entry
        log.info("linear %sx%s: %s", shape[0], shape[1],
                 {r: e[0] for r, e in entry.items()})
    return report

"""Copying checkpoint tensors into parameters.

A parameter may carry its own `weight_loader(param, loaded_weight, shard_id)`
attribute (fused linear layers and quantization methods attach one); plain
parameters use `default_weight_loader`. Loaders convert the loaded tensor to the
parameter's dtype and device, and raise `ModelLoadError` on a shape mismatch.
"""
from __future__ import annotations

import torch

from slipstream.errors import ModelLoadError


def copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src) after checking shapes; copy_ converts dtype and device."""
    if dst.shape != src.shape:
        raise ModelLoadError(
            f"shape mismatch: checkpoint has {tuple(src.shape)}, model expects {tuple(dst.shape)}")
    dst.copy_(src)


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor,
                          shard_id: object = None) -> None:
    assert shard_id is None, "an unfused parameter has no shards"
    copy_checked(param.data, loaded_weight)

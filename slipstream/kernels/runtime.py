"""What the kernel launchers ask of the Triton runtime."""
from __future__ import annotations

import functools
import os

import torch


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (CI)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def num_sms(device_index: int = 0) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _fix_interpreter_scalar_index() -> None:
    """Triton 3.6's interpreter holds scalars as 1-element arrays and turns them
    into loop bounds with int(array), which NumPy >= 2.3 refuses for arrays of
    ndim > 0: every `range(lo, hi)` over runtime values fails. Read the element
    instead. Only ever applied under the interpreter."""
    import numpy as np
    from triton.runtime import interpreter

    if getattr(interpreter, "_slipstream_index_fix", False):
        return
    patch_tensor = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
    interpreter._slipstream_index_fix = True


if interpreting():
    _fix_interpreter_scalar_index()


@functools.cache
def capability(device_index: int = 0) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def pdl_supported(t: torch.Tensor) -> bool:
    """Programmatic dependent launch (Hopper and later, compiled kernels): a
    kernel may be launched before the one ahead of it in the stream finishes,
    and waits for it (`gdc_wait`) only where it reads that kernel's output.
    Asked on every launch, so answered once per device."""
    return t.is_cuda and _pdl_device(t.device.index or 0)


# The norms, SiLU x up and rotary + KV store may launch behind the kernel ahead of
# them (programmatic dependent launch), so that their launch and the load of a
# norm's weight overlap that kernel's tail. Off: measured on an H200 (Llama-3-8B
# shape, benchmarks/runtime/bench_switch.py --switch pdl) it moved batch-1 decode by +0.2% and made
# batches 8 and 64 1% slower.
EARLY_ELEMENTWISE = False


def pdl_elementwise(t: torch.Tensor) -> bool:
    """Whether a row-wise kernel (norm, SiLU x up, rotary + KV store) launches early."""
    return EARLY_ELEMENTWISE and pdl_supported(t)


@functools.cache
def _pdl_device(device_index: int) -> bool:
    if os.environ.get("SLIPSTREAM_DISABLE_PDL", "0") not in ("", "0"):
        return False
    return not interpreting() and capability(device_index)[0] >= 9

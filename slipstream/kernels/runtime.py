"""What the kernel launchers ask of the Triton runtime."""
from __future__ import annotations

import functools
import os

import torch


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (CI)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _alloc(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_tma_allocator() -> None:
    """Kernels that build TMA descriptors on the device need a little global
    scratch per launch; hand Triton torch's caching allocator for it (no sync,
    and graph-capture safe). Triton keeps the allocator in a context variable,
    so it is set on every launch: a new thread starts without one."""
    if not interpreting():
        import triton
        triton.set_allocator(_alloc)


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

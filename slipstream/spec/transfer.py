"""Host <-> device copies that never stall the host on the device's queue.

A blocking copy from pageable memory (`torch.tensor(list, device="cuda")`,
`.to("cuda")` of a plain CPU tensor, `.tolist()` or `.item()` of a device
tensor) waits for everything queued on the stream. On a launch-bound GPU step
that wait serialises host and device. These helpers go through pinned memory
instead: host -> device copies are queued and return at once; a device ->
host copy is queued with an event, and `HostCopy.wait()` waits for that event
alone (the one intended wait of a speculation round). On the CPU they are
plain tensors.
"""
from __future__ import annotations

import numpy as np
import torch


def to_device(data, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """data: a list, numpy array or CPU tensor -> a tensor on `device`, copied
    without waiting (the pinned staging copy is kept alive by torch's caching
    host allocator until the copy has run)."""
    device = torch.device(device)
    if isinstance(data, np.ndarray):
        t = torch.from_numpy(np.ascontiguousarray(data)).to(dtype)
    else:
        t = torch.as_tensor(data, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class HostCopy:
    """A device tensor's copy to pinned host memory, started now; `wait()`
    returns the host tensor once it has landed."""

    def __init__(self, t: torch.Tensor):
        if t.device.type != "cuda":
            self.host, self.event = t, None
            return
        self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self.host.copy_(t, non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record()

    def wait(self) -> torch.Tensor:
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        return self.host

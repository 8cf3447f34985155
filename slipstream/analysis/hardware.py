"""What an accelerator can do: peak memory bandwidth and matmul rate.

Two sources: datasheet figures for the GPUs the reference chapter discusses,
and profiles measured on the machine at hand (`measure_profile`), stored as
JSON so that later benchmarks compare themselves against the same ceiling.
"""
from __future__ import annotations

import json
import os
import platform
import re
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

# Compute dtype -> the HardwareProfile field holding its dense peak. fp16 and
# bf16 share tensor-core rates on every GPU here.
_PEAK_FIELD = {"bf16": "bf16_flops", "fp16": "bf16_flops", "fp8": "fp8_flops", "int8": "int8_ops"}


@dataclass(frozen=True)
class HardwareProfile:
    """Roofline parameters of one device. Rates are dense (no 2:4 sparsity)."""
    name: str
    memory_bandwidth: float          # bytes/s of off-chip (HBM/DRAM) traffic, reads + writes
    bf16_flops: float                # FLOP/s of a large bf16 matmul
    fp8_flops: float | None = None   # None: no fp8 tensor cores (fp8 weights upcast to bf16)
    int8_ops: float | None = None
    memory_bytes: float | None = None
    source: str = "datasheet"        # "datasheet" or "measured on <device>"

    def peak_flops(self, compute_dtype: str = "bf16") -> float:
        """Peak rate for matmuls computed in `compute_dtype`; falls back to bf16
        where the device lacks a faster unit for it (e.g. fp8 on A100)."""
        try:
            attr = _PEAK_FIELD[compute_dtype]
        except KeyError:
            raise ValueError(f"compute dtype {compute_dtype!r}: choose from {', '.join(_PEAK_FIELD)}") from None
        rate = getattr(self, attr)
        return rate if rate is not None else self.bf16_flops

    def times(self, n: int) -> "HardwareProfile":
        """n devices working as one (tensor parallel), communication ignored:
        an upper bound, as every roofline figure is."""
        if n == 1:
            return self
        scale = lambda x: None if x is None else x * n  # noqa: E731
        return HardwareProfile(f"{n}x{self.name}", self.memory_bandwidth * n, self.bf16_flops * n,
                               scale(self.fp8_flops), scale(self.int8_ops),
                               scale(self.memory_bytes), self.source)

    def critical_intensity(self, compute_dtype: str = "bf16") -> float:
        """FLOPs per byte at which the compute roof meets the bandwidth roof."""
        return self.peak_flops(compute_dtype) / self.memory_bandwidth


# SXM parts, dense rates from NVIDIA's datasheets (A100 80GB SXM4, H100 SXM5,
# H200 SXM, HGX B200 at 1000 W). NVIDIA headline figures for H100 and later
# are 2:4-sparse rates, twice these.
GPUS: dict[str, HardwareProfile] = {
    "A100": HardwareProfile("A100", 2.039e12, 312e12, None, 624e12, 80e9),
    "H100": HardwareProfile("H100", 3.35e12, 989.4e12, 1978.9e12, 1978.9e12, 80e9),
    "H200": HardwareProfile("H200", 4.8e12, 989.4e12, 1978.9e12, 1978.9e12, 141e9),
    "B200": HardwareProfile("B200", 8.0e12, 2250e12, 4500e12, 4500e12, 180e9),
}


def profile_dir() -> Path:
    """Where measured profiles live; SLIPSTREAM_HARDWARE_DIR overrides."""
    env = os.environ.get("SLIPSTREAM_HARDWARE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "slipstream" / "hardware"


def _file_stem(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


def save_profile(profile: HardwareProfile, path: str | Path | None = None) -> Path:
    """Write `profile` as JSON (default: profile_dir()/<device-name>.json)."""
    path = Path(path) if path is not None else profile_dir() / f"{_file_stem(profile.name)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(profile), indent=2) + "\n")
    return path


def load_profile(path: str | Path) -> HardwareProfile:
    data = json.loads(Path(path).read_text())
    return HardwareProfile(**data)


def get_hardware(name: str) -> HardwareProfile:
    """A datasheet GPU ("H100", case-insensitive), a profile JSON path, or the
    name of a profile stored in profile_dir()."""
    key = name.upper().split("-")[0]
    if key in GPUS:
        return GPUS[key]
    for candidate in (Path(name), profile_dir() / f"{_file_stem(name)}.json"):
        if candidate.is_file():
            return load_profile(candidate)
    raise ValueError(f"unknown hardware {name!r}: use one of {', '.join(GPUS)}, "
                     f"a profile JSON path, or a profile stored in {profile_dir()}")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu-{platform.machine() or 'unknown'}"


def _median_seconds(fn: Callable[[], object], device: torch.device,
                    warmup: int = 3, repeats: int = 10) -> float:
    """Median wall time of `fn` after warm-up; CUDA events on the GPU so that
    only device time is counted, not launch overhead of the first call."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(repeats):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _default_copy_bytes(device: torch.device) -> int:
    # Far above the L2 of every GPU here so that the copy streams from HBM;
    # on the CPU, above a typical last-level cache yet quick to run.
    return (1 << 30) if device.type == "cuda" else (64 << 20)


def measure_copy_bandwidth(device: str | torch.device, nbytes: int | None = None,
                           repeats: int = 10) -> float:
    """Bytes read + written per second by a device-to-device copy of `nbytes`
    of random data (median of `repeats` runs after warm-up)."""
    device = torch.device(device)
    nbytes = nbytes or _default_copy_bytes(device)
    src = torch.rand(max(nbytes // 4, 1), dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    seconds = _median_seconds(lambda: dst.copy_(src), device, repeats=repeats)
    return 2 * src.numel() * src.element_size() / seconds


def measure_matmul_rate(device: str | torch.device, dtype: torch.dtype = torch.bfloat16,
                        n: int | None = None, repeats: int = 10) -> float:
    """FLOP/s of an n x n x n matmul on random inputs (2 n^3 FLOPs per call)."""
    device = torch.device(device)
    n = n or (8192 if device.type == "cuda" else 512)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    seconds = _median_seconds(lambda: torch.mm(a, b, out=out), device, repeats=repeats)
    return 2 * n ** 3 / seconds


def measure_profile(device: str | torch.device = "cuda", copy_bytes: int | None = None,
                    matmul_n: int | None = None) -> HardwareProfile:
    """Measure bandwidth and bf16 matmul rate of `device` into a profile."""
    device = torch.device(device)
    name = device_name(device)
    memory = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    return HardwareProfile(
        name=name,
        memory_bandwidth=measure_copy_bandwidth(device, copy_bytes),
        bf16_flops=measure_matmul_rate(device, torch.bfloat16, matmul_n),
        memory_bytes=memory,
        source=f"measured on {name}",
    )

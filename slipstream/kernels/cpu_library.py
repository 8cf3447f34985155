"""Building and loading the CPU kernels of `cpu_quant.c`.

The C file is compiled at first use with the system's C compiler
(`-O3 -march=native`: each machine gets code for its own vector units, AVX2
or AVX-512, detected by the compiler at build time, never assumed) into a
cache folder, and loaded with ctypes. It needs no Python headers and no torch
headers, so it builds in about a second. Without a compiler (or with
`SLIPSTREAM_NO_CPU_KERNELS=1`) `load()` returns None and callers take their
pure-torch path.

Cache: `$SLIPSTREAM_CACHE` or `$XDG_CACHE_HOME/slipstream` or
`~/.cache/slipstream`; the library's name hashes the source, the compiler
and the CPU's flags, so a changed machine or source rebuilds. On a CPU with
AMX-INT8 the build includes the tile kernels of `cpu_amx.c` (`set_amx`).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import weakref
from pathlib import Path

_SOURCE = Path(__file__).with_name("cpu_quant.c")
_INCLUDED = [Path(__file__).with_name(n) for n in ("cpu_q4x16.c", "cpu_q8x16.c", "cpu_amx.c", "cpu_tree_attention.c", "cpu_decoder.c", "cpu_eagle.c")]   # #included by _SOURCE
# SLIPSTREAM_CPU_ARCH picks another target (tests build `haswell`, an AVX2-only CPU,
# and `x86-64`, no vector extensions, to check the paths this machine would not take).
_ARCH = os.environ.get("SLIPSTREAM_CPU_ARCH", "native")
_FLAGS = ["-O3", f"-march={_ARCH}", "-shared", "-fPIC", "-pthread"]
_lib = None
_tried = False
_threads: int | None = None
_error: str | None = None

_i64, _i32, _f32, _p = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
_SIGNATURES = {
    "ss_supported": ([_i32], _i32),
    "ss_set_threads": ([_i32], _i32),
    "ss_set_amx": ([_i32], _i32),
    "ss_get_threads": ([], _i32),
    "ss_pool_test_delay": ([_i32], None),
    "ss_matmul": ([_i32, _p, _p, _p, _i64, _p, _i64, _p, _i64], _i32),
    "ss_dequant": ([_i32, _p, _i64, _i64, _p], _i32),
    "ss_get_rows": ([_i32, _p, _i64, _p, _i64, _p], _i32),
    "ss_row_argmax": ([_p, _i64, _i64, _p], _i32),
    "ss_row_candidates": ([_p, _i64, _i64, _f32, _i64, _p, _p, _p], _i32),
    "ss_decode_attention": ([_p, _i64, _p, _p, _i32, _p, _i64, _p, _i64, _i32, _i32, _i32, _i32, _f32,
                             _i64, _p, _i64, _p, _i64, _p, _p, _p], _i32),
    "ss_repack_q4x16": ([_i32, _p, _i64, _i64, _p], _i32),
    "ss_repack_q8x16": ([_p, _i64, _i64, _p], _i32),
    "ss_decode_step": ([_p, _p, _i64, _p, _p, _i64, _p, _p], _i32),
    "ss_tree_attention": ([_p, _i64, _p, _p, _i32, _p, _i64, _p, _p, _p, _i64, _i32, _i32, _i32, _i32, _i32,
                           _f32, _i64, _p, _i64, _p, _i64, _p, _p], _i32),
    "ss_tree_step": ([_p, _p, _p, _p, _i64, _p, _p, _i64, _p, _p, _i32], _i32),
    "ss_eagle_pass": ([_p, _p, _p, _i64, _p, _p, _p, _p, _i64, _p, _p, _p], _i32),
    "ss_eagle_chain": ([_p, _p, _p, _p, _p, _i64, _i64, _i32, _i32, _f32, _f32, _p, _p, _p, _p], _i32),
}


def _cache_dir() -> Path:
    root = os.environ.get("SLIPSTREAM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "slipstream")
    return Path(root)


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    import platform
    return platform.processor() + platform.machine()


def _compiler() -> str | None:
    cc = os.environ.get("CC")
    if cc and shutil.which(cc):
        return cc
    for name in ("cc", "gcc", "clang"):
        if shutil.which(name):
            return name
    return None


def _build(cc: str) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    source = b"".join(p.read_bytes() for p in [_SOURCE, *_INCLUDED])
    key = hashlib.sha256(source + version.encode() + _cpu_flags().encode()
                         + " ".join(_FLAGS).encode()).hexdigest()[:16]
    out = _cache_dir() / f"cpu_quant-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # build beside the target, then rename: concurrent first runs never see half a file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        r = subprocess.run([cc, *_FLAGS, "-o", tmp, str(_SOURCE)], capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"{cc} failed: {r.stderr.strip()[:500]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def load():
    """The ctypes library, or None when it cannot be built here (see `error()`)."""
    global _lib, _tried, _error
    if _tried:
        return _lib
    _tried = True
    if os.environ.get("SLIPSTREAM_NO_CPU_KERNELS"):
        _error = "turned off by SLIPSTREAM_NO_CPU_KERNELS"
        return None
    cc = _compiler()
    if cc is None:
        _error = "no C compiler (cc, gcc or clang) found"
        return None
    try:
        lib = ctypes.CDLL(str(_build(cc)))
    except (OSError, RuntimeError) as e:
        _error = str(e)
        print(f"slipstream: CPU kernels unavailable ({e}); using the torch path", file=sys.stderr)
        return None
    for name, (args, res) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    _lib = lib
    set_threads(None)
    set_amx(os.environ.get("SLIPSTREAM_CPU_AMX", "1") not in ("", "0"))
    return _lib


def error() -> str | None:
    return _error


def set_threads(n: int | None) -> int:
    """Threads the kernels use, the caller included (None: the count set before,
    else torch's, which follows OMP_NUM_THREADS and `--threads`)."""
    global _threads
    if _lib is None:
        return 1
    if n is None:
        import torch
        n = _threads or torch.get_num_threads()
    _threads = _lib.ss_set_threads(int(n))
    return _threads


def set_amx(enable: bool | None = None) -> bool:
    """Whether products of several rows of x (verification steps, prompts) run on AMX
    tiles (cpu_amx.c): True only where the build targets AMX-INT8 and the OS grants the
    tile state. enable: switch them on / off (SLIPSTREAM_CPU_AMX=0 starts off); None asks."""
    if _lib is None:
        return False
    return bool(_lib.ss_set_amx(-1 if enable is None else int(enable)))


def threads() -> int:
    """Threads the kernels run on (1 before they are loaded)."""
    return _threads or 1


def take_threads(owner=None) -> int:
    """Give the CPU threads to the kernels' pool and run torch's own ops on one.

    Two pools of spinning threads on the same cores slow each other down (and a
    torch OpenMP barrier waits for a descheduled thread: a shared machine
    collapses). When the kernels carry the heavy work, torch keeps one thread.
    owner: an object that lives as long as the model whose products the pool
    carries; `release_threads` gives torch its threads back once none is alive."""
    global took_threads, _torch_threads
    import torch
    if owner is not None:
        _owners.add(owner)
    if took_threads:            # (a quantized model calls this for each of its layers)
        return threads()
    _torch_threads = torch.get_num_threads()
    n = set_threads(None)
    torch.set_num_threads(1)
    took_threads = True
    return n


def release_threads() -> bool:
    """torch's threads back (as before `take_threads`) when no model whose products the
    pool carries is alive: a dense model loaded after a GGUF one was dropped must not
    run its products on one thread. True when given back."""
    global took_threads
    if not took_threads:
        return False
    if len(_owners):
        import gc
        gc.collect()            # an engine dropped by the caller may sit in a cycle
    if len(_owners):
        return False
    import torch
    torch.set_num_threads(_torch_threads)
    took_threads = False
    return True


_owners: "weakref.WeakSet" = weakref.WeakSet()
_torch_threads = 1
took_threads = False     # take_threads ran: products left to torch get one thread

"""A GGUF file's header, read directly from a memory map.

The `gguf` package's `GGUFReader` builds numpy views for every part of every
metadata field (hundreds of thousands for a vocabulary), which takes seconds.
Here scalars and numeric arrays are read straight from the map, string arrays
(vocabulary, merges) are decoded only when asked for, and tensor data is
returned as zero-copy uint8 views of the map.

    f = GGUFFile(path)
    f.meta["general.architecture"]      # plain Python values (strings, numbers, lists)
    f.array_len("tokenizer.ggml.tokens")
    f.tensors["blk.0.attn_q.weight"]   # TensorInfo(type, shape, offset, nbytes)
    f.raw(info)                         # uint8 tensor [rows, row_bytes] over the file
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from slipstream.errors import ModelLoadError

# ggml type id -> (elements per block, bytes per block); from ggml.h
GGML_BLOCKS = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24),
               8: (32, 34), 9: (32, 36), 10: (256, 84), 11: (256, 110), 12: (256, 144),
               13: (256, 176), 14: (256, 210), 15: (256, 292), 16: (256, 66), 17: (256, 74),
               18: (256, 98), 19: (256, 50), 20: (32, 18), 21: (256, 110), 22: (256, 82),
               23: (256, 136), 24: (1, 1), 25: (1, 2), 26: (1, 4), 27: (1, 8), 28: (1, 8),
               29: (256, 56), 30: (1, 2), 34: (256, 54), 35: (256, 66), 39: (32, 17)}

# metadata value type -> (struct format, size); 8 string, 9 array
_SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
            6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
          6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type: int                 # ggml type id
    shape: tuple[int, ...]    # PyTorch order (slowest dim first)
    offset: int               # absolute byte offset in the file
    nbytes: int


class _LazyStrings:
    """A string array left in the file: (offset, count)."""
    def __init__(self, offset: int, count: int):
        self.offset, self.count = offset, count


class GGUFFile:
    def __init__(self, path: Path):
        self.path = path
        try:
            with open(path, "rb") as f:
                # a private copy-on-write map: tensors made from it are writable views, and
                # nothing is ever written back to the file
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{path}: cannot map the file ({e})") from None
        self._buf = memoryview(self._map)
        try:
            self._parse()
        except (struct.error, IndexError, ValueError, UnicodeDecodeError, OverflowError) as e:
            raise ModelLoadError(
                f"{path}: not a readable GGUF file, truncated or corrupt ({type(e).__name__}: {e})") from None
        size = len(self._map)
        end = max((t.offset + t.nbytes for t in self.tensors.values()), default=0)
        if end > size:
            raise ModelLoadError(f"{path}: truncated GGUF file: tensor data runs to byte {end}, the file has {size}")

    # ---- parsing ---------------------------------------------------------
    def _read(self, fmt: str, size: int):
        v = struct.unpack_from(fmt, self._buf, self._pos)[0]
        self._pos += size
        return v

    def _string(self) -> str:
        n = self._read("<Q", 8)
        if self._pos + n > len(self._buf):
            raise ValueError("a string runs past the end of the file")
        s = bytes(self._buf[self._pos:self._pos + n]).decode("utf-8")
        self._pos += n
        return s

    def _strings(self, lazy: _LazyStrings) -> list[str]:
        raw, pos, out = self._map, lazy.offset, []
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(lazy.count):
            n = unpack(raw, pos)[0]
            out.append(raw[pos + 8:pos + 8 + n])
            pos += 8 + n
        if pos > len(raw):
            raise ModelLoadError(f"{self.path}: a string array runs past the end of the file")
        return [b.decode("utf-8", "replace") for b in out]

    def _skip_strings(self, count: int) -> None:
        buf, pos = self._buf, self._pos
        for _ in range(count):
            pos += 8 + struct.unpack_from("<Q", buf, pos)[0]
        if pos > len(buf):
            raise ValueError("a string array runs past the end of the file")
        self._pos = pos

    def _value(self, vtype: int):
        if vtype in _SCALARS:
            return self._read(*_SCALARS[vtype])
        if vtype == 8:
            return self._string()
        if vtype == 9:
            etype, count = self._read("<I", 4), self._read("<Q", 8)
            if etype in _NUMPY:
                dt = np.dtype(_NUMPY[etype])
                arr = np.frombuffer(self._buf, dt, count, self._pos)
                self._pos += dt.itemsize * count
                return arr
            if etype == 8:
                lazy = _LazyStrings(self._pos, count)
                self._skip_strings(count)
                return lazy
            return [self._value(etype) for _ in range(count)]
        raise ValueError(f"unknown metadata value type {vtype}")

    def _parse(self) -> None:
        self._pos = 0
        if bytes(self._buf[:4]) != b"GGUF":
            raise ValueError("no GGUF magic")
        self._pos = 4
        version = self._read("<I", 4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (big-endian or unknown)")
        n_tensors, n_kv = self._read("<Q", 8), self._read("<Q", 8)
        self._fields: dict[str, object] = {}
        for _ in range(n_kv):
            key = self._string()
            self._fields[key] = self._value(self._read("<I", 4))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._read("<I", 4)
            dims = [self._read("<Q", 8) for _ in range(n_dims)]
            infos.append((name, dims, self._read("<I", 4), self._read("<Q", 8)))
        align = int(self._fields.get("general.alignment", 32))
        start = (self._pos + align - 1) // align * align
        self.tensors: dict[str, TensorInfo] = {}
        for name, dims, qtype, off in infos:
            if qtype not in GGML_BLOCKS:
                raise ValueError(f"tensor {name} has unknown ggml type {qtype}")
            qk, nb = GGML_BLOCKS[qtype]
            n = int(np.prod(dims, dtype=np.int64)) if dims else 1
            self.tensors[name] = TensorInfo(name, qtype, tuple(int(d) for d in reversed(dims)),
                                            start + off, n // qk * nb)
        self.meta = {k: self._plain(v) for k, v in self._fields.items()
                     if not isinstance(v, _LazyStrings)}

    @staticmethod
    def _plain(v):
        return v.tolist() if isinstance(v, np.ndarray) else v

    # ---- access ----------------------------------------------------------
    def array_len(self, key: str) -> int | None:
        v = self._fields.get(key)
        if v is None:
            return None
        return v.count if isinstance(v, _LazyStrings) else len(v)

    def value(self, key: str, default=None):
        """A field's value, decoding string arrays (vocabularies) on first use."""
        v = self._fields.get(key, default)
        if isinstance(v, _LazyStrings):
            v = self._fields[key] = self._strings(v)
        return self._plain(v)

    def keys(self):
        return self._fields.keys()

    def raw(self, info: TensorInfo) -> torch.Tensor:
        """The tensor's bytes as uint8 [rows, row_bytes] (rows: all but the last dim), no copy."""
        flat = torch.frombuffer(self._buf, dtype=torch.uint8, count=info.nbytes, offset=info.offset)
        rows = int(np.prod(info.shape[:-1], dtype=np.int64)) if len(info.shape) > 1 else 1
        return flat.view(rows, info.nbytes // rows)

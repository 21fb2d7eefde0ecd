"""A GGUF file's header, metadata and tensor directory, parsed in one pass over a read-only memory map.

Spec: ggml `docs/gguf.md` ("File Structure"): magic "GGUF", uint32 version (2 or 3), uint64 tensor count, uint64
metadata count; each metadata entry a string key (uint64 length + UTF-8 bytes), a uint32 value type and the value
(arrays: uint32 element type, uint64 count, the elements); each tensor info a string name, uint32 n_dims, uint64
dims (innermost first), uint32 ggml type, uint64 offset into the data section, which starts at the next multiple of
`general.alignment` (default 32).

Why not the `gguf` package's `GGUFReader`: it builds a numpy view per value (one per token of the vocabulary, two
per merge), seconds and a hundred MB and more for the default model's 49k-entry tokenizer on every load, and its memmap
subclass costs a Python call per slice. Here numeric arrays are read with one `np.frombuffer` each and strings with
one decode each; `metadata` holds the same values as `{key: field.contents()}` of `GGUFReader`, and `tensors` the
same fields as its `ReaderTensor` (name, tensor_type, shape, n_elements, n_bytes, data_offset, data), `data` a plain
ndarray over the map in the same dtype and shape. The `gguf` package stays the reference: tests/model/test_gguf_reader.py.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from model.loaders.errors import CheckpointError
from model.loaders.ggml_types import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# GGUFValueType: the scalar types' struct codes (little-endian files; ggml writes nothing else in practice)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
STRING, ARRAY = 8, 9
# ggml types whose data `GGUFReader` views as typed elements (every other type as its blocks' bytes)
_ELEMENT_TYPES = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
                  GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                  GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                  GGMLQuantizationType.I64: np.int64}


class GGUFTensor(NamedTuple):
    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray  # (n_dims,) uint64, innermost first, as ggml lists them
    n_elements: int
    n_bytes: int
    data_offset: int  # from the start of the file
    data: np.ndarray  # a read-only view of the map: (outer dims..., elements or bytes of a row)


_U64 = struct.Struct("<Q")


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: str) -> Any:
        (v,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.take("Q")
        if self.pos + n > len(self.buf):
            raise ValueError(f"a string of {n} bytes at byte {self.pos} runs past the end of the file")
        s = str(self.buf[self.pos : self.pos + n], "utf-8")
        self.pos += n
        return s

    def strings(self, n: int) -> list[str]:
        """`n` strings in a row, as `string` reads each, in one loop without its per-call overhead: a vocabulary's
        tokens and merges are 100,000 strings and more."""
        buf, pos, end, out = self.buf, self.pos, len(self.buf), []
        length = _U64.unpack_from
        for _ in range(n):
            (k,) = length(buf, pos)
            pos += 8
            if pos + k > end:
                raise ValueError(f"a string of {k} bytes at byte {pos} runs past the end of the file")
            out.append(str(buf[pos : pos + k], "utf-8"))
            pos += k
        self.pos = pos
        return out

    def value(self, vtype: int) -> Any:
        if vtype == STRING:
            return self.string()
        if vtype == ARRAY:
            etype, n = self.take("I"), self.take("Q")
            if etype == STRING:
                return self.strings(n)
            if etype == ARRAY:
                return [self.value(ARRAY) for _ in range(n)]
            dt = np.dtype(_NUMPY[etype]).newbyteorder("<")
            if self.pos + n * dt.itemsize > len(self.buf):
                raise ValueError(f"an array of {n} values at byte {self.pos} runs past the end of the file")
            out = np.frombuffer(self.buf, dtype=dt, count=n, offset=self.pos).tolist()
            self.pos += n * dt.itemsize
            return out
        if vtype not in _SCALARS:
            raise ValueError(f"unknown metadata value type {vtype}")
        return self.take(_SCALARS[vtype])


class GGUFFile:
    """`metadata`: key -> value (str, int, float, bool, or a list of them); `tensors`: the directory in file order,
    each viewing its data in the map (pages are read on first touch; `release` drops them from the process)."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        with open(self.path, "rb") as f:
            size = f.seek(0, 2)
            if size == 0:
                raise CheckpointError("cannot read GGUF (truncated or not a GGUF file?): the file is empty", path=self.path)
            self.mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            self._parse(size)
        except (struct.error, ValueError, UnicodeDecodeError, KeyError) as e:
            raise CheckpointError(f"cannot read GGUF (truncated or not a GGUF file?): {type(e).__name__}: {e}",
                                  path=self.path) from None

    def _parse(self, size: int) -> None:
        cur = _Cursor(memoryview(self.mm))
        if bytes(cur.buf[:4]) != MAGIC:
            raise ValueError("GGUF magic invalid")
        cur.pos = 4
        version = cur.take("I")
        if version not in VERSIONS:
            raise ValueError(f"GGUF version {version} (this reader knows {', '.join(map(str, VERSIONS))})")
        n_tensors, n_kv = cur.take("Q"), cur.take("Q")
        meta: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": n_tensors, "GGUF.kv_count": n_kv}
        for _ in range(n_kv):
            key = cur.string()
            meta[key] = cur.value(cur.take("I"))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.take("I")
            dims = [cur.take("Q") for _ in range(n_dims)]
            infos.append((name, dims, cur.take("I"), cur.take("Q")))
        align = meta.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise ValueError(f"invalid general.alignment {align!r}: must be a power of two")
        start = -(-cur.pos // align) * align
        self.metadata, self.data_start, self.tensors = meta, start, []
        seen: set[str] = set()
        for name, dims, type_id, offset in infos:
            if name in seen:
                raise ValueError(f"tensor {name!r} listed twice")
            seen.add(name)
            try:
                qtype = GGMLQuantizationType(type_id)
            except ValueError:
                raise CheckpointError(f"unknown ggml tensor type id {type_id}", path=self.path, tensor=name) from None
            block, type_size = GGML_QUANT_SIZES[qtype]
            n = 1
            for d in dims:
                n *= d
            n_bytes, begin = n * type_size // block, start + offset
            if begin + n_bytes > size:
                raise CheckpointError(f"file is truncated: tensor data ends at byte {begin + n_bytes} ({qtype.name}, "
                                      f"shape {dims}, {n_bytes} bytes) but the file has {size} bytes",
                                      path=self.path, tensor=name)
            outer = tuple(reversed(dims))
            element = _ELEMENT_TYPES.get(qtype)
            if element is not None:
                data = np.frombuffer(self.mm, dtype=element, count=n, offset=begin).reshape(outer)
            else:  # the blocks' bytes: a row of `dims[0]` elements is dims[0] / block blocks
                data = np.frombuffer(self.mm, dtype=np.uint8, count=n_bytes, offset=begin)
                data = data.reshape(*outer[:-1], outer[-1] // block * type_size)
            self.tensors.append(GGUFTensor(name, qtype, np.array(dims, dtype=np.uint64), n, n_bytes, begin, data))

    def release(self, t: GGUFTensor) -> None:
        """Drop tensor `t`'s file pages from this process (`MADV_DONTNEED` on its range of the read-only map): they
        stay in the page cache, but no longer count in the process's memory, so the peak while loading is what it
        keeps, not what it kept plus every page of the file it has read."""
        if not hasattr(mmap, "MADV_DONTNEED"):
            return
        begin = t.data_offset // mmap.PAGESIZE * mmap.PAGESIZE
        try:
            self.mm.madvise(mmap.MADV_DONTNEED, begin, t.data_offset + t.n_bytes - begin)
        except (OSError, ValueError):
            pass

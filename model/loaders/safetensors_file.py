"""safetensors files read one tensor at a time into memory of our own, never through a memory map.

Format (huggingface/safetensors README "Format"): an 8-byte little-endian header length N, N bytes of JSON
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}, then the data, offsets relative to
its start. Reading through `safe_open`'s memory map leaves every page of a shard it has touched counted in the
process's memory until the shard is closed (a 5 GB shard of an 8B model: 5 GB on top of the weights); a plain read
into a fresh tensor costs that tensor only.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

from model.loaders.errors import CheckpointError

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
MAX_HEADER = 100 << 20  # the format's own limit on the header


class SafetensorsFile:
    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        try:
            self.file = open(self.path, "rb")
        except OSError as e:
            raise CheckpointError(f"cannot open: {e.strerror}", path=self.path) from None
        size = os.fstat(self.file.fileno()).st_size
        try:
            (n,) = struct.unpack("<Q", self.file.read(8))
            if n > MAX_HEADER or 8 + n > size:
                raise ValueError(f"header of {n} bytes in a file of {size}")
            header = json.loads(self.file.read(n))
        except (struct.error, ValueError, UnicodeDecodeError) as e:
            self.file.close()
            raise CheckpointError(f"cannot read safetensors data (truncated or corrupt file?): {e}", path=self.path) from None
        header.pop("__metadata__", None)
        self.start, self.entries = 8 + n, header
        for name, e in header.items():
            end = self.start + e["data_offsets"][1]
            if end > size:
                self.file.close()
                raise CheckpointError(f"cannot read safetensors data (truncated file?): tensor {name!r} ends at byte "
                                      f"{end} but the file has {size} bytes", path=self.path)

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()

    def keys(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name]["shape"])

    def nbytes(self, name: str) -> int:
        begin, end = self.entries[name]["data_offsets"]
        return end - begin

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor `name` (or only its rows [a, b) of the outermost dim: contiguous bytes) in a tensor of its own."""
        e = self.entries[name]
        dtype = DTYPES.get(e["dtype"])
        if dtype is None:
            raise CheckpointError(f"unsupported safetensors dtype {e['dtype']}", path=self.path, tensor=name)
        shape = list(e["shape"])
        begin, end = e["data_offsets"]
        itemsize = torch.empty((), dtype=dtype).element_size()
        numel = 1
        for s in shape:
            numel *= s
        if end - begin != numel * itemsize:
            raise CheckpointError(f"data of {end - begin} bytes does not fill shape {shape} ({e['dtype']})",
                                  path=self.path, tensor=name)
        if rows is not None:
            row_bytes = (end - begin) // max(shape[0], 1)
            begin, shape[0] = begin + rows[0] * row_bytes, rows[1] - rows[0]
            end = begin + shape[0] * row_bytes
        out = torch.empty(end - begin, dtype=torch.uint8)
        self.file.seek(self.start + begin)
        if self.file.readinto(out.numpy()) != end - begin:
            raise CheckpointError("cannot read safetensors data (truncated file?)", path=self.path, tensor=name)
        return out.view(dtype).view(shape)

"""Element ranges of tensors in a ``.safetensors`` file, read with ``pread`` (no memory map).

The format: 8 bytes little-endian header length, a JSON header (name -> dtype, shape, byte offsets in the
data section), the data section. A rank reading its part of a parameter reads exactly those bytes into a
new tensor. A memory map (``safetensors.safe_open``) would be as exact, but the pages it touches count in
the process's resident memory (``VmRSS``/``VmHWM``) until the map is dropped: a rank reading half of a
model's file then looks half a model larger. Memory: the elements asked for.
"""
from __future__ import annotations

import json
import os
import struct
from typing import Any

import torch

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}


class SafetensorsFile:
    """One ``.safetensors`` file: its tensor names, shapes and dtypes, and ranged reads."""

    def __init__(self, path: str) -> None:
        self.path = path
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header: dict[str, Any] = json.loads(f.read(length))
        header.pop("__metadata__", None)
        self.data_start = 8 + length
        self.entries = header
        for name, entry in header.items():
            if entry["dtype"] not in DTYPES:
                raise ValueError(f"{path}: tensor {name!r} has dtype {entry['dtype']}, which zeroplus does not read")
        needed = self.data_start + max((e["data_offsets"][1] for e in header.values()), default=0)
        if os.path.getsize(path) < needed:  # a truncated file is refused before anything is read from it
            raise ValueError(f"{path} is truncated: {os.path.getsize(path)} bytes, its header needs {needed}")

    def keys(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name]["shape"])

    def read(self, name: str, start: int, end: int) -> torch.Tensor:
        """Elements ``[start, end)`` of the flattened tensor ``name``."""
        entry = self.entries[name]
        dtype = DTYPES[entry["dtype"]]
        size = torch.empty(0, dtype=dtype).element_size()
        first = self.data_start + entry["data_offsets"][0] + start * size
        out = torch.empty(max(0, end - start) * size, dtype=torch.uint8)
        with open(self.path, "rb", buffering=0) as f:
            got = os.preadv(f.fileno(), [out.numpy().data], first) if out.numel() else 0
        if got != out.numel():
            raise OSError(f"{self.path}: tensor {name!r} is shorter than its header says "
                          f"(read {got} of {out.numel()} bytes at offset {first})")
        return out.view(dtype)

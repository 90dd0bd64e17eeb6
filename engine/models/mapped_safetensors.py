"""A safetensors file's tensors as views of the file mapped into memory, not copies.

safetensors' own `get_tensor` copies each tensor into fresh memory, so loading a checkpoint held it
twice (the copies, then the model's parameters): a 15 GB model needed 30 GB to start. Views of a
private (copy-on-write) mapping sit in the page cache, which the kernel can drop, so a load peaks at
about one model's size. A tensor the format stores unaligned or in a type not listed here is copied.
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

import torch

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def mapped_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file by name, each a view of the mapped file where it can be."""
    with open(path, "rb") as file:
        (header_size,) = struct.unpack("<Q", file.read(8))
        header = json.loads(file.read(header_size))
        header.pop("__metadata__", None)
        if not header:
            return {}
        mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
    start = 8 + header_size
    tensors = {}
    for name, entry in header.items():
        begin, end = (start + offset for offset in entry["data_offsets"])
        shape = tuple(int(n) for n in entry["shape"])
        dtype = DTYPES.get(entry["dtype"])
        if dtype is None or begin % dtype.itemsize or end == begin:
            tensors[name] = _copied(path, name)
            continue
        tensors[name] = torch.frombuffer(mapped, dtype=dtype, count=(end - begin) // dtype.itemsize,
                                         offset=begin).view(shape)
    return tensors


def _copied(path: str | Path, name: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor(name)

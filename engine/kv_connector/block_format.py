"""One stored KV block: a small header, then K and V of every layer for the block's tokens.

Header (little-endian): magic ``BIKV``, version, dtype name, shape, payload length, sha256 of the
payload. A reader checks all of them against what it expects, so a truncated or corrupted blob (or
one from another layout) is refused, never loaded.
"""

from __future__ import annotations

import hashlib
import struct

import torch

MAGIC = b"BIKV"
VERSION = 1
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_FIXED = struct.Struct("<4sHB")  # magic, version, dtype-name length


class CorruptBlockError(ValueError):
    """A stored block that is not what its key promises: truncated, corrupted or of another layout."""


def encode_block(block: torch.Tensor) -> bytes:
    """`block`: one block's ``[layers, 2, kv_heads, block_size, head_dim]`` K/V, on any device."""
    name = _NAMES[block.dtype].encode()
    payload = _payload_bytes(block)
    header = _FIXED.pack(MAGIC, VERSION, len(name)) + name
    header += struct.pack(f"<B{block.dim()}I", block.dim(), *block.shape)
    header += struct.pack("<Q", len(payload)) + hashlib.sha256(payload).digest()
    return header + payload


def decode_block(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The block's tensor (CPU); raises CorruptBlockError naming what does not match."""
    view = memoryview(data)
    try:
        magic, version, name_len = _FIXED.unpack_from(view, 0)
        offset = _FIXED.size
        name = bytes(view[offset : offset + name_len]).decode("ascii", "replace")
        offset += name_len
        (ndim,) = struct.unpack_from("<B", view, offset)
        stored_shape = struct.unpack_from(f"<{ndim}I", view, offset + 1)
        offset += 1 + 4 * ndim
        (length,) = struct.unpack_from("<Q", view, offset)
        checksum = bytes(view[offset + 8 : offset + 40])
        offset += 40
    except struct.error as exc:
        raise CorruptBlockError(f"truncated header ({len(data)} bytes)") from exc
    if magic != MAGIC or version != VERSION:
        raise CorruptBlockError(f"not a KV block (magic {magic!r}, version {version})")
    if name != _NAMES.get(dtype) or tuple(stored_shape) != tuple(shape):
        raise CorruptBlockError(
            f"block is {name} {tuple(stored_shape)}, expected {_NAMES.get(dtype)} {tuple(shape)}")
    payload = view[offset:]
    if len(payload) != length or length != _numel(shape) * dtype.itemsize:
        raise CorruptBlockError(f"payload is {len(payload)} bytes, header says {length}")
    if hashlib.sha256(payload).digest() != checksum:
        raise CorruptBlockError("payload checksum does not match")
    return torch.frombuffer(bytearray(payload), dtype=dtype).view(shape)


def _payload_bytes(block: torch.Tensor) -> bytes:
    flat = block.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes()


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count

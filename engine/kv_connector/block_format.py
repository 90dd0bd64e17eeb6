"""One stored KV block: a small header, then K and V of every layer for the block's tokens.

Header (little-endian): magic ``BIKV``, version, dtype name, shape, payload length, sha256 of the
payload. A reader checks all of them against what it expects, so a truncated or corrupted blob (or
one from another layout) is refused, never loaded.

Encoding and checking are pure Python (hashlib, struct) on bytes: they run on the connector's I/O
threads, where a torch op would start an OpenMP thread team per thread whose spinning slows the
step loop's own kernels. The tensor side (`block_payload`, `payload_tensor`) runs on the step thread.
"""

from __future__ import annotations

import hashlib
import struct

import torch

MAGIC = b"BIKV"
VERSION = 1
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_FIXED = struct.Struct("<4sHB")  # magic, version, dtype-name length


class CorruptBlockError(ValueError):
    """A stored block that is not what its key promises: truncated, corrupted or of another layout."""


def encode_payload(payload: bytes | memoryview, dtype_name: str, shape: tuple[int, ...]) -> bytes:
    """The blob of one block whose K/V bytes are `payload` (pure Python)."""
    name = dtype_name.encode()
    header = _FIXED.pack(MAGIC, VERSION, len(name)) + name
    header += struct.pack(f"<B{len(shape)}I", len(shape), *shape)
    header += struct.pack("<Q", len(payload)) + hashlib.sha256(payload).digest()
    return header + bytes(payload)


def checked_payload(data: bytes, dtype_name: str, shape: tuple[int, ...], itemsize: int) -> bytearray:
    """The K/V bytes of a blob, after checking its header and checksum (pure Python); raises
    CorruptBlockError naming what does not match."""
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
    if name != dtype_name or tuple(stored_shape) != tuple(shape):
        raise CorruptBlockError(
            f"block is {name} {tuple(stored_shape)}, expected {dtype_name} {tuple(shape)}")
    payload = view[offset:]
    if len(payload) != length or length != _numel(shape) * itemsize:
        raise CorruptBlockError(f"payload is {len(payload)} bytes, header says {length}")
    if hashlib.sha256(payload).digest() != checksum:
        raise CorruptBlockError("payload checksum does not match")
    return bytearray(payload)  # writable, for torch.frombuffer


def block_payload(block: torch.Tensor) -> memoryview:
    """A block tensor's bytes (a contiguous CPU copy where it is not one already)."""
    flat = block.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().data


def payload_tensor(payload: bytearray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.frombuffer(payload, dtype=dtype).view(shape)


def encode_block(block: torch.Tensor) -> bytes:
    """`block`: one block's ``[layers, 2, kv_heads, block_size, head_dim]`` K/V, on any device."""
    return encode_payload(block_payload(block), DTYPE_NAMES[block.dtype], tuple(block.shape))


def decode_block(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The block's tensor (CPU); raises CorruptBlockError naming what does not match."""
    name = DTYPE_NAMES.get(dtype, str(dtype))
    return payload_tensor(checked_payload(data, name, shape, dtype.itemsize), dtype, shape)


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count

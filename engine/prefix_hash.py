"""Stable chained hashes of full KV blocks, the keys of the prefix cache.

A block's hash covers its parent's hash, its token ids and (first block only) extra keys such as
the model id and the request's cache salt; the chain carries them to every later block. sha256 over
a fixed little-endian encoding, never Python's `hash()`, so the same prefix hashes the same in
every process and on every machine (a cache could later be shared across workers).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from typing import NewType

BlockHash = NewType("BlockHash", bytes)

_NO_PARENT = b"\x00"
_HAS_PARENT = b"\x01"


def hash_block_tokens(
    parent_hash: BlockHash | None, token_ids: Sequence[int], extra_keys: Sequence[str] = ()
) -> BlockHash:
    """Hash one full block. Every field is length-prefixed so no two inputs share an encoding."""
    digest = hashlib.sha256()
    digest.update(_NO_PARENT if parent_hash is None else _HAS_PARENT + parent_hash)
    digest.update(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    for key in extra_keys:
        encoded = key.encode("utf-8")
        digest.update(struct.pack("<I", len(encoded)))
        digest.update(encoded)
    return BlockHash(digest.digest())


def extend_block_hashes(
    block_hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: Sequence[str] = (),
    block_keys: Callable[[int], Sequence[str]] | None = None,
) -> None:
    """Append the hashes of full blocks of `token_ids` not hashed yet (each block is hashed once).
    `block_keys(index)`: keys of that block alone (the images whose tokens it holds)."""
    num_full_blocks = len(token_ids) // block_size
    for index in range(len(block_hashes), num_full_blocks):
        parent = block_hashes[index - 1] if index > 0 else None
        start = index * block_size
        block_tokens = token_ids[start : start + block_size]
        keys = extra_keys if index == 0 else ()
        if block_keys is not None:
            keys = (*keys, *block_keys(index))
        block_hashes.append(hash_block_tokens(parent, block_tokens, keys))

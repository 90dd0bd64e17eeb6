"""What the store holds, per namespace, and removal by prefix: for `bulkinfer kv ls|rm`, without an
engine (pure Python; no torch)."""

from __future__ import annotations

from dataclasses import dataclass

from bulkinfer.engine.kv_connector.blob_store import KVBlobStore
from bulkinfer.engine.kv_connector.keys import ROOT


@dataclass(frozen=True)
class NamespaceEntry:
    namespace: str  # e.g. "kv/3f2a…/bf16/tp0of1/b16/hnd/"
    blocks: int
    bytes: int
    last_used: float  # the most recent use of any of its blocks (seconds since the epoch)


def list_entries(store: KVBlobStore, prefix: str = ROOT) -> list[NamespaceEntry]:
    """One entry per namespace under `prefix`, sorted by namespace."""
    totals: dict[str, list[float]] = {}
    for info in store.list(prefix):
        # kv/<model>/<dtype>/<tp>/<block size>/<layout>/<block hash>: all but the hash (a store written
        # before the layout was named has one part fewer, and lists as its own namespace)
        name = info.key.rsplit("/", 1)[0] + "/" if "/" in info.key else info.key
        entry = totals.setdefault(name, [0, 0, 0.0])
        entry[0] += 1
        entry[1] += info.size
        entry[2] = max(entry[2], info.last_used)
    return [NamespaceEntry(name, int(blocks), int(size), last_used)
            for name, (blocks, size, last_used) in sorted(totals.items())]


def remove(store: KVBlobStore, prefix: str) -> int:
    """Delete every block under `prefix` (a namespace, or "kv/" for all); returns how many."""
    if not prefix.startswith(ROOT):
        raise ValueError(f"prefix must start with {ROOT!r}, got {prefix!r}")
    keys = [info.key for info in store.list(prefix)]
    for key in keys:
        store.delete(key)
    return len(keys)

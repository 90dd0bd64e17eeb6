"""An adapter's identity in KV block hashes: a digest of its files' content, not its name or id.

KV computed with an adapter follows from its weights and its config (the scale), so blocks are keyed
by the bytes the engine loaded: an adapter replaced under the same name, id or folder hashes anew
and never matches blocks computed with the old files, in the prefix cache or in a KV store shared
by workers, while the same files reached under two names or folders share their blocks.
"""

from __future__ import annotations

import hashlib
import struct


def adapter_digest(config_bytes: bytes, weights_bytes: bytes) -> str:
    """sha256 (hex) over both files, each length-prefixed so no two pairs share an encoding."""
    digest = hashlib.sha256()
    for part in (config_bytes, weights_bytes):
        digest.update(struct.pack("<Q", len(part)))
        digest.update(part)
    return digest.hexdigest()

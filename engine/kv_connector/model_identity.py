"""A model's identity for store keys: the same weights give the same id on every worker, whatever
folder they were loaded from; another checkpoint (a fine-tune of the same shape) gives another.

Reading every weight would cost seconds per GiB at each start, so the id covers config.json, each
safetensors file's name, size and header (names, dtypes, shapes, offsets) and 64 KiB samples at 16
evenly spaced offsets of its data: a fine-tune changes every tensor, so the samples differ.
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

SAMPLES_PER_FILE = 16
SAMPLE_BYTES = 64 << 10


def model_identity(model_dir: str | Path) -> str:
    folder = Path(model_dir)
    digest = hashlib.sha256()
    config = folder / "config.json"
    if config.is_file():
        digest.update(config.read_bytes())
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        # config.json alone would give two checkpoints of one shape the same id, and so each other's KV.
        raise ValueError(f"no safetensors weights in {folder}: cannot name the model's KV in a store")
    for path in weights:
        size = path.stat().st_size
        digest.update(path.name.encode() + struct.pack("<Q", size))
        with path.open("rb") as handle:
            (header_len,) = struct.unpack("<Q", handle.read(8))
            digest.update(handle.read(min(header_len, size)))
            data_start = 8 + header_len
            span = max(0, size - data_start - SAMPLE_BYTES)
            for index in range(SAMPLES_PER_FILE):
                handle.seek(data_start + span * index // max(1, SAMPLES_PER_FILE - 1))
                digest.update(handle.read(SAMPLE_BYTES))
    return digest.hexdigest()

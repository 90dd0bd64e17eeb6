"""Store keys of prefix KV blocks: a namespace per model, dtype, tensor-parallel rank, block size and
KV layout, then the block's chained hash (which already covers the tenant's cache salt, the LoRA adapter and
the model), so nothing is ever shared across tenants, models or precisions."""

from __future__ import annotations

import hashlib

from bulkinfer.engine.kv_layout import KV_LAYOUT

ROOT = "kv/"
DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def namespace(model_id: str, dtype: str, tp_rank: int, tp_size: int, block_size: int,
              layout: str = KV_LAYOUT) -> str:
    """e.g. ``kv/3f2a…/bf16/tp0of1/b16/hnd/``; `model_id` is the model's identity (model_identity.py),
    `layout` the caches' memory layout (engine/kv_layout.py)."""
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_NAMES)}, got {dtype!r}")
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} is not a rank of tp_size {tp_size}")
    digest = hashlib.sha256(model_id.encode("utf-8")).hexdigest()[:32]
    return f"{ROOT}{digest}/{DTYPE_NAMES[dtype]}/tp{tp_rank}of{tp_size}/b{block_size}/{layout}/"


def block_key(namespace_prefix: str, block_hash: bytes) -> str:
    return namespace_prefix + block_hash.hex()

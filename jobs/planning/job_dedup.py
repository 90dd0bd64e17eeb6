"""Identical rows across a job's shards: found once at planning, computed once when running.

The planner reads every row once (inputs up to `MAX_SCAN_ROWS`) and keys each deterministic row
(greedy, or seeded) by its prompt or messages, sampling and response format. A row whose key an
earlier shard holds becomes a *copy*: its shard's plan maps its position to the source's (shard,
position), and the source shard's plan lists that position among its *exports*. A running shard
writes its exported rows' outcomes to `dedup/part-NNNNN.<fence>.json` (under its run's fencing
token) before it commits, and fills its copies from the exports of the run whose result its sources
committed (a source has a lower index, so it is running or done by then; see
worker/shards/shard_copies.py), so a copy equals its source's committed row even when two runs of the
source raced. Identical rows inside one shard are left to the shard's own deduplication.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Sequence
from typing import Any

from bulkinfer.jobs.embedding import base64_vector, vector_from_base64
from bulkinfer.jobs.formats.image_parts import iter_image_parts
from bulkinfer.jobs.formats.output import (
    Choice,
    OutputRow,
    PositionLogprobs,
    PromptLogprobs,
    TokenLogprob,
    ToolCall,
)
from bulkinfer.jobs.formats.readers import read_shard_rows
from bulkinfer.jobs.formats.rows import Row
from bulkinfer.jobs.lora_adapters import UnknownAdapter
from bulkinfer.jobs.model_registry import ModelRegistry
from bulkinfer.jobs.object_store.base import ObjectStore
from bulkinfer.jobs.planning.sharding import ShardPlan
from bulkinfer.jobs.spec import JobSpec

MAX_SCAN_ROWS = 1_000_000  # a larger input keeps the per-shard deduplication only
DEFAULT_MAX_KEYS = 1_000_000  # settings.dedup_max_keys: distinct rows remembered (~120 B each)

logger = logging.getLogger(__name__)


def row_key(row: Row) -> str | None:
    """The key of a row that computes the same output every time it runs; None otherwise."""
    digest = row_digest(row)
    return None if digest is None else digest.hex()


def row_digest(row: Row) -> bytes | None:
    """`row_key` as 16 bytes (what the planner keeps in memory per distinct row)."""
    if row.embed is not None:  # embeddings are deterministic: the same inputs, the same vectors
        content: list[Any] = ["embed", repr(row.embed)]
        return hashlib.sha256(json.dumps(content).encode("utf-8", "surrogatepass")).digest()[:16]
    if not (row.sampling.temperature == 0 or row.sampling.seed is not None):
        return None
    content = [row.prompt, row.messages, row.sampling.model_dump(mode="json"), row.response_format]
    # Rows equal but for their adapter are not copies. Left out for the base, so keys stay as before.
    if row.lora is not None:
        content.append(["lora", row.lora])
    # An image_column row's images are in its chat form only: rows with other images are not copies.
    if row.as_chat is not None and next(iter_image_parts(row.as_chat), None) is not None:
        content.append(["images", row.as_chat])
    return hashlib.sha256(json.dumps(content, sort_keys=True, default=str).encode()).digest()[:16]


def with_resolved_adapter(row: Row, registry: ModelRegistry | None, model: str) -> Row | None:
    """The row naming the adapter it will run on (an OpenAI line's `model` of OpenAI's: the base), so
    rows that run alike get one key; None for a row whose adapter is not registered (it fails).
    Without a registry the row as it is: names that differ only never merge rows that should not."""
    if registry is None or row.lora is None:
        return row
    try:
        adapter = registry.row_adapter(model, row.lora, row.lora_required)
    except UnknownAdapter:
        return None
    return dataclasses.replace(row, lora=adapter, lora_required=True)


def mark_copies(store: ObjectStore, key: str, spec: JobSpec, plan: Sequence[ShardPlan],
                max_keys: int = DEFAULT_MAX_KEYS, registry: ModelRegistry | None = None) -> list[ShardPlan]:
    """The plan with cross-shard copies and exports marked (unchanged when the spec turns
    deduplication off or the input has more than MAX_SCAN_ROWS rows).

    Memory is bounded: each distinct row is remembered as a 16-byte digest with one int (its shard
    and position), at most `max_keys` of them. The row that would need one more ends the scan:
    cross-shard deduplication stops there for the rest of the job (the copies marked before stay
    right; later rows run, identical ones inside a shard still once).
    """
    if not spec.deduplicate or max_keys <= 0 or sum(shard.estimated_rows for shard in plan) > MAX_SCAN_ROWS:
        return list(plan)
    first: dict[bytes, int] = {}  # row digest -> source shard << 32 | position
    copies: dict[int, dict[int, list[int]]] = {}
    exports: dict[int, set[int]] = {}
    for shard in plan:
        for position, item in enumerate(read_shard_rows(store, key, spec, shard)):
            row = with_resolved_adapter(item, registry, spec.model) if isinstance(item, Row) else None
            digest = row_digest(row) if row is not None else None
            if digest is None:
                continue
            source = first.get(digest)
            if source is None:
                if len(first) >= max_keys:
                    logger.info("cross-shard deduplication stops at shard %d row %d: %d distinct rows "
                                "remembered (dedup_max_keys)", shard.index, position, len(first))
                    return _marked(plan, copies, exports)
                first[digest] = shard.index << 32 | position
            elif source >> 32 != shard.index:
                source_shard, source_position = source >> 32, source & 0xFFFFFFFF
                copies.setdefault(shard.index, {})[position] = [source_shard, source_position]
                exports.setdefault(source_shard, set()).add(source_position)
    return _marked(plan, copies, exports)


def _marked(plan: Sequence[ShardPlan], copies: dict[int, dict[int, list[int]]],
            exports: dict[int, set[int]]) -> list[ShardPlan]:
    return [shard.model_copy(update={"copies": copies.get(shard.index, {}),
                                     "exports": sorted(exports.get(shard.index, ()))})
            if shard.index in copies or shard.index in exports else shard for shard in plan]


def exports_key(job_dir: str, shard_index: int, fence: str | None) -> str:
    """Where the run with fencing token `fence` writes the shard's exports (None: a result committed
    without a fence, by a worker that wrote its exports in place)."""
    name = f"part-{shard_index:05d}" if fence is None else f"part-{shard_index:05d}.{fence}"
    return f"{job_dir}/dedup/{name}.json"


def dump_outputs(outputs: dict[int, OutputRow]) -> bytes:
    return json.dumps({str(position): _fields(row) for position, row in outputs.items()},
                      ensure_ascii=False, default=str).encode()


def _fields(row: OutputRow) -> dict[str, Any]:
    fields = dataclasses.asdict(row)
    if row.embeddings is not None:  # float32 vectors kept exact: their little-endian bytes, base64
        fields["embeddings"] = [base64_vector(vector) for vector in row.embeddings]
    return fields


def load_outputs(data: bytes) -> dict[int, OutputRow]:
    return {int(position): _output_row(fields) for position, fields in json.loads(data).items()}


def _output_row(fields: dict[str, Any]) -> OutputRow:
    choices = tuple(Choice(**{**choice, "logprobs": _positions(choice.get("logprobs")),
                              "tool_calls": tuple(ToolCall(**call) for call in choice.get("tool_calls", ()))})
                    for choice in fields.get("choices") or ())
    embeddings = fields.get("embeddings")
    if embeddings is not None:
        embeddings = tuple(vector_from_base64(text) for text in embeddings)
    prompt = fields.get("prompt_logprobs")
    if prompt is not None:
        prompt = PromptLogprobs(**{**prompt, "positions": _positions(prompt["positions"])})
    return OutputRow(**{**fields, "choices": choices, "embeddings": embeddings, "prompt_logprobs": prompt})


def _positions(positions: list[dict[str, Any]] | None) -> list[PositionLogprobs] | None:
    if positions is None:
        return None
    return [PositionLogprobs(TokenLogprob(**position["chosen"]),
                             [TokenLogprob(**top) for top in position["top"]]) for position in positions]

"""An embed job's outputs: its vectors in Parquet, JSONL and OpenAI's embeddings response body.

A row of a Parquet or JSONL input has one input, so one vector: `embedding` (Parquet:
`fixed_size_list<float32>[dim]`, which reads straight into a 2-D numpy array; JSONL: a float list).
A row of an OpenAI batch input may have several inputs (and its own `dimensions`): written to
Parquet or JSONL it gets `embeddings` instead, a list of float lists, one per input.
"""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING, Any

from bulkinfer.jobs.embedding import base64_vector
from bulkinfer.jobs.formats.output import OutputRow
from bulkinfer.jobs.spec import InputFormat, JobSpec

if TYPE_CHECKING:
    import pyarrow as pa


def embedding_column_name(spec: JobSpec) -> str:
    """`embeddings` (a list per row) when rows may hold several inputs, else `embedding`."""
    return "embeddings" if spec.input_format == InputFormat.OPENAI_BATCH else "embedding"


def embedding_table(rows: list[OutputRow], spec: JobSpec, dimension: int | None = None) -> pa.Table:
    """Columns: id, embedding (or embeddings), prompt_tokens, error_code, error, then the passthrough
    columns. `dimension`: the vectors' size (the model's, or the job's `dimensions`), so that a part
    whose rows all failed still has the job's column type; learnt from the rows when not given."""
    import pyarrow as pa

    from bulkinfer.jobs.formats.parquet_writer import _passthrough_array

    columns: dict[str, pa.Array] = {"id": pa.array([row.row_id for row in rows], pa.string())}
    name = embedding_column_name(spec)
    if name == "embeddings":
        vectors = [None if row.embeddings is None else [vector.tolist() for vector in row.embeddings]
                   for row in rows]
        columns[name] = pa.array(vectors, pa.list_(pa.list_(pa.float32())))
    else:
        size = spec.dimensions or dimension or _row_dimension(rows)
        columns[name] = _fixed_size_vectors(rows, size)
    columns["prompt_tokens"] = pa.array([row.prompt_tokens for row in rows], pa.int64())
    columns["error_code"] = pa.array([row.error_code for row in rows], pa.string())
    columns["error"] = pa.array([row.error_message for row in rows], pa.string())
    for column in spec.passthrough_columns:
        columns[column] = _passthrough_array([row.passthrough.get(column) for row in rows])
    return pa.table(columns)


def _row_dimension(rows: list[OutputRow]) -> int | None:
    return next((len(row.embeddings[0]) for row in rows if row.embeddings), None)


def _fixed_size_vectors(rows: list[OutputRow], size: int | None) -> pa.Array:
    """One float32 vector of `size` per row, null for a failed row (a plain float list when no size
    is known: a part of failed rows only, in a job without `dimensions`)."""
    import pyarrow as pa

    if size is None:
        return pa.array([None] * len(rows), pa.list_(pa.float32()))
    flat = array("f")
    valid = []
    for row in rows:
        vector = row.embeddings[0] if row.embeddings else None
        if vector is not None and len(vector) != size:
            raise ValueError(f"row {row.row_id!r}: a vector of {len(vector)} values in a column of {size}")
        flat.extend(vector if vector is not None else array("f", bytes(4 * size)))
        valid.append(vector is not None)
    values = pa.Array.from_buffers(pa.float32(), len(flat), [None, pa.py_buffer(flat.tobytes())])
    mask = pa.array([not ok for ok in valid], pa.bool_())
    return pa.FixedSizeListArray.from_arrays(values, size, mask=mask)


def jsonl_embedding_record(row: OutputRow, spec: JobSpec) -> dict[str, Any]:
    """`{"id", "embedding" (or "embeddings"), "usage", "error", ...}` (then the passthrough columns)."""
    name = embedding_column_name(spec)
    vectors = None if row.embeddings is None else [vector.tolist() for vector in row.embeddings]
    record: dict[str, Any] = {"id": row.row_id,
                              name: vectors if name == "embeddings" or vectors is None else vectors[0]}
    record["usage"] = None if row.prompt_tokens is None else {
        "prompt_tokens": row.prompt_tokens, "cached_tokens": 0, "completion_tokens": 0}
    record["error"] = None if not row.failed else {"code": row.error_code, "message": row.error_message}
    record.update(row.passthrough)
    return record


def embeddings_body(row: OutputRow, model: str) -> dict[str, Any]:
    """OpenAI's `CreateEmbeddingResponse`: `{object: list, data: [{object: embedding, index,
    embedding}], model, usage: {prompt_tokens, total_tokens}}`; base64 vectors as little-endian float32."""
    as_base64 = row.encoding_format == "base64"
    data = [{"object": "embedding", "index": index,
             "embedding": base64_vector(vector) if as_base64 else vector.tolist()}
            for index, vector in enumerate(row.embeddings or ())]
    tokens = row.prompt_tokens or 0
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

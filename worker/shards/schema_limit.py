"""`max_schemas_per_job`: how many distinct response formats one job's rows may carry.

Each distinct schema is a grammar the engine compiles once (it caches grammars by schema), for up
to its `compile_timeout_s`; rows sharing a schema cost nothing more. Rows may each bring their own
(`response_format_column`, OpenAI batch bodies), so without a limit one job could keep a worker
compiling for hours. With it, a job's compile time is bounded by max_schemas_per_job x
compile_timeout_s whatever its size: each shard admits its rows' distinct schemas into a job-wide
Redis set, atomically and up to the limit, and a row whose schema is past it gets the row error
`too_many_schemas` instead of a compile. A rerun of a shard finds its schemas already admitted.
The set lives as long as the job's other Redis state; after a Redis loss it starts afresh (so at
most one more limit's worth).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import redis

from bulkinfer.engine.structured_output.spec import canonical_json
from bulkinfer.jobs.formats.rows import Row, RowError, RowErrorCode
from bulkinfer.jobs.names import schemas_key

DEFAULT_MAX_SCHEMAS_PER_JOB = 256
SCHEMAS_TTL_S = 7 * 24 * 3600  # as long as the shard leases' bookkeeping

# KEYS: the job's schema set. ARGV: limit, ttl s, then schema digests. Returns the digests refused.
ADMIT_SCRIPT = """
local refused = {}
for i = 3, #ARGV do
  if redis.call('SISMEMBER', KEYS[1], ARGV[i]) == 0 then
    if redis.call('SCARD', KEYS[1]) < tonumber(ARGV[1]) then
      redis.call('SADD', KEYS[1], ARGV[i])
    else
      table.insert(refused, ARGV[i])
    end
  end
end
redis.call('EXPIRE', KEYS[1], ARGV[2])
return refused
"""


def schema_digest(response_format: dict[str, Any]) -> str:
    """Formats the engine compiles once share a digest: its own cache key (keys sorted, but a
    `properties` map in its order, which is the outputs' field order)."""
    text = canonical_json(response_format)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def limit_schemas(client: redis.Redis, namespace: str, job_id: str, items: Sequence[Row | RowError],
                  limit: int = DEFAULT_MAX_SCHEMAS_PER_JOB) -> list[Row | RowError]:
    """The shard's rows, those whose schema is past the job's limit turned into row errors."""
    digests = {id(item): schema_digest(item.response_format) for item in items
               if isinstance(item, Row) and item.response_format is not None}
    if not digests:
        return list(items)
    admit = client.register_script(ADMIT_SCRIPT)
    ordered = list(dict.fromkeys(digests.values()))  # first use in the shard first
    answer = admit(keys=[schemas_key(namespace, job_id)], args=[limit, SCHEMAS_TTL_S, *ordered])
    refused = {digest.decode() if isinstance(digest, bytes) else digest for digest in answer}
    if not refused:
        return list(items)
    message = (f"the job's rows carry more than {limit} distinct response formats (max_schemas_per_job); "
               "each distinct schema is compiled on its own, so past the limit rows are refused: use "
               "fewer distinct schemas (or one job-wide response_format)")
    code = RowErrorCode.TOO_MANY_SCHEMAS
    return [RowError(item.index, item.row_id, code, message, item.line, item.passthrough)
            if isinstance(item, Row) and digests.get(id(item)) in refused else item
            for item in items]


def limit_schemas_streamed(client: redis.Redis, namespace: str, job_id: str, items: Iterable[Row | RowError],
                           limit: int = DEFAULT_MAX_SCHEMAS_PER_JOB,
                           chunk_rows: int = 1024) -> Iterator[Row | RowError]:
    """`limit_schemas` over rows read lazily, `chunk_rows` at a time (schemas admitted in order)."""
    chunk: list[Row | RowError] = []
    for item in items:
        chunk.append(item)
        if len(chunk) >= chunk_rows:
            yield from limit_schemas(client, namespace, job_id, chunk, limit)
            chunk = []
    if chunk:
        yield from limit_schemas(client, namespace, job_id, chunk, limit)

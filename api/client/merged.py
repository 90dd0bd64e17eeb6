"""`client.jobs.results(job, merged=True)`: one row per input row across a retry chain.

The server merges (`GET /jobs/{id}/results/merged`): for every input row, the latest success among
the job and the jobs it retried, else the latest error, in input order, as JSON lines.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from bulkinfer.api.client.results import (
    CHUNK_BYTES,
    DELIMITED_FORMATS,
    LineSplitter,
    _require_pandas,
    _temp_for,
    json_rows_async,
    table_from_rows,
    target_format,
    write_csv_table,
    write_table,
)

if TYPE_CHECKING:
    import pyarrow as pa

    from bulkinfer.api.client.transport import AsyncTransport, Transport


class _ChainHeaders:
    """What the server says about the chain, known once the rows have started to come."""

    chain: list[str] | None = None
    missing_shards: int | None = None

    def _read(self, response: httpx.Response) -> None:
        self.chain = [job for job in response.headers.get("x-bulkinfer-chain", "").split(",") if job]
        self.missing_shards = int(response.headers.get("x-bulkinfer-missing-shards", "0"))


class MergedResults(_ChainHeaders):
    """Iterate for dicts; `.to_arrow()`, `.to_pandas()`, `.download(path)`. After the first read,
    `.chain` is the chain's job ids (oldest first) and `.missing_shards` how many shards no job in it
    has finished (their rows are not there; 0 when every row is)."""

    def __init__(self, transport: Transport, job_id: str) -> None:
        self._transport = transport
        self.job_id = job_id

    def _chunks(self) -> Iterator[bytes]:
        with self._transport.stream("GET", f"/jobs/{self.job_id}/results/merged") as response:
            self._read(response)
            yield from response.iter_bytes(CHUNK_BYTES)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        splitter = LineSplitter()
        for chunk in self._chunks():
            yield from splitter.feed(chunk)
        yield from splitter.finish()

    def to_arrow(self) -> pa.Table:
        return table_from_rows(list(self))

    def to_pandas(self) -> Any:
        _require_pandas()
        return self.to_arrow().to_pandas()

    def download(self, path: str | Path) -> Path:
        """JSON lines, or Parquet for a `.parquet` path, CSV for `.csv`, TSV for `.tsv`. Returns the path."""
        path = Path(path)
        temp = _temp_for(path)
        wanted = target_format(path, "jsonl")
        if wanted == "parquet":
            write_table(self.to_arrow(), temp)
        elif wanted in DELIMITED_FORMATS:
            write_csv_table(self.to_arrow(), temp, wanted)
        else:
            with temp.open("wb") as out:
                for chunk in self._chunks():
                    out.write(chunk)
        temp.replace(path)
        return path


class AsyncMergedResults(_ChainHeaders):
    """`MergedResults` for the async client: `async for row in merged`, `await merged.rows()`."""

    def __init__(self, transport: AsyncTransport, job_id: str) -> None:
        self._transport = transport
        self.job_id = job_id

    async def _chunks(self) -> AsyncIterator[bytes]:
        async with self._transport.stream("GET", f"/jobs/{self.job_id}/results/merged") as response:
            self._read(response)
            async for chunk in response.aiter_bytes(CHUNK_BYTES):
                yield chunk

    async def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        async for row in json_rows_async(self._chunks()):
            yield row

    async def rows(self) -> list[dict[str, Any]]:
        return [row async for row in self]

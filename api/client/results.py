"""Reading a succeeded job's output: `client.jobs.results(job)`.

Rows stream straight from the result parts (presigned S3 URLs, or `file://` paths when the store is
on this machine), part by part in input order, so the API server does not carry the bytes. When a
part cannot be read from here (a local store on another machine), or a Parquet part without pyarrow
installed, the rows come through the server's `?download=true` stream instead (JSON lines).

    results = client.jobs.results(job)
    for row in results: ...          # dicts, in input order
    table = results.to_arrow()       # pyarrow (the `client` extra)
    frame = results.to_pandas()      # pandas, if installed
    results.download("out.parquet")  # the format follows the suffix; else the job's output format
"""

from __future__ import annotations

import io
import json
from collections.abc import AsyncIterator, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

from bulkinfer.api.client.models import JobResults, ResultPart

if TYPE_CHECKING:
    import pyarrow as pa

    from bulkinfer.api.client.transport import AsyncTransport, Transport

CHUNK_BYTES = 1 << 20
PARQUET_SUFFIXES = (".parquet", ".pq")
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")


def _pyarrow() -> Any:
    try:
        import pyarrow
    except ModuleNotFoundError:
        raise ModuleNotFoundError("reading results as a table needs pyarrow: "
                                  "pip install 'bulkinfer[client]'") from None
    return pyarrow


def _require_pandas() -> None:
    try:
        import pandas  # noqa: F401
    except ModuleNotFoundError:
        raise ModuleNotFoundError("to_pandas needs pandas: pip install pandas") from None


def _has_pyarrow() -> bool:
    try:
        import pyarrow.parquet  # noqa: F401
    except ModuleNotFoundError:
        return False
    return True


def local_path(url: str) -> Path | None:
    """The path behind a `file://` part URL (None for http)."""
    if not url.startswith("file://"):
        return None
    return Path(unquote(urlparse(url).path))


def readable_here(part: ResultPart) -> bool:
    path = local_path(part.url)
    return path.is_file() if path is not None else part.url.startswith(("http://", "https://"))


def read_local(path: Path) -> Iterator[bytes]:
    with path.open("rb") as stream:
        while chunk := stream.read(CHUNK_BYTES):
            yield chunk


class LineSplitter:
    """JSON lines from byte chunks that may cut a line anywhere."""

    def __init__(self) -> None:
        self._tail = b""

    def feed(self, chunk: bytes) -> list[dict[str, Any]]:
        lines = (self._tail + chunk).split(b"\n")
        self._tail = lines.pop()
        return [json.loads(line) for line in lines if line.strip()]

    def finish(self) -> list[dict[str, Any]]:
        tail, self._tail = self._tail, b""
        return [json.loads(tail)] if tail.strip() else []


def parquet_table(data: bytes) -> pa.Table:
    import pyarrow.parquet as pq

    return pq.read_table(io.BytesIO(data))


def concat(tables: list[pa.Table]) -> pa.Table:
    pa = _pyarrow()
    if not tables:
        return pa.table({})
    return pa.concat_tables(tables, promote_options="default")  # a column all-null in one part is fine


def table_from_rows(rows: list[dict[str, Any]]) -> pa.Table:
    return _pyarrow().Table.from_pylist(rows)


def target_format(path: Path, output_format: str) -> str:
    """`parquet` or `jsonl`: what a download to `path` writes."""
    suffix = path.suffix.lower()
    if suffix in PARQUET_SUFFIXES:
        return "parquet"
    if suffix in JSONL_SUFFIXES:
        return "jsonl"
    return "parquet" if output_format == "parquet" else "jsonl"


def json_line(row: dict[str, Any]) -> bytes:
    return json.dumps(row, ensure_ascii=False, default=str).encode() + b"\n"


def write_table(table: pa.Table, path: Path) -> None:
    import pyarrow.parquet as pq

    pq.write_table(table, path)


def _temp_for(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return path.with_name(f".{path.name}.part")  # renamed into place once whole


def _query(partial: bool) -> dict[str, str]:
    return {"partial": "true"} if partial else {}


class Results:
    """The rows of a succeeded job (sync), or with `partial` the rows of the shards finished so far
    of a job in any state (`info.partial` says which). Iterating twice reads the parts twice."""

    def __init__(self, transport: Transport, job_id: str, partial: bool = False) -> None:
        self._transport = transport
        self.job_id = job_id
        self._query = _query(partial)
        self._info: JobResults | None = None

    @property
    def info(self) -> JobResults:
        """The part list (`GET /jobs/{id}/results`), fetched once; `ApiError` 409 unless the job succeeded
        or `partial` was asked for."""
        if self._info is None:
            response = self._transport.request("GET", f"/jobs/{self.job_id}/results", params=self._query,
                                               idempotent=True)
            self._info = JobResults.model_validate(response.json())
        return self._info

    @property
    def partial(self) -> bool:
        """True unless the job had succeeded: these are only the shards finished when asked."""
        return self.info.partial

    @property
    def output_format(self) -> str:
        return self.info.output_format

    def _direct(self) -> bool:
        info = self.info
        return all(readable_here(part) for part in info.parts) and (
            info.output_format != "parquet" or _has_pyarrow())

    def _part_chunks(self, part: ResultPart) -> Iterator[bytes]:
        path = local_path(part.url)
        if path is not None:
            yield from read_local(path)
            return
        with self._transport.stream("GET", part.url, external=True) as response:
            yield from response.iter_bytes(CHUNK_BYTES)

    def _chunks(self) -> Iterator[bytes]:
        """The JSON-lines bytes of every row: the parts themselves, or the server's stream."""
        if self._direct():
            for part in self.info.parts:
                yield from self._part_chunks(part)
            return
        with self._transport.stream("GET", f"/jobs/{self.job_id}/results",
                                    params={"download": "true", **self._query}) as response:
            yield from response.iter_bytes(CHUNK_BYTES)

    def _part_tables(self) -> Iterator[pa.Table]:
        for part in self.info.parts:
            yield parquet_table(b"".join(self._part_chunks(part)))

    def _parquet_direct(self) -> bool:
        return self._direct() and self.output_format == "parquet"

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if self._parquet_direct():
            for table in self._part_tables():
                yield from table.to_pylist()
            return
        yield from _json_rows(self._chunks())

    def to_arrow(self) -> pa.Table:
        """Every row as one pyarrow Table (Parquet parts keep their column types)."""
        if self._parquet_direct():
            return concat(list(self._part_tables()))
        return table_from_rows(list(self))

    def to_pandas(self) -> Any:
        """Every row as a pandas DataFrame (needs pandas)."""
        _require_pandas()
        return self.to_arrow().to_pandas()

    def download(self, path: str | Path) -> Path:
        """Write every row to one file: Parquet for a `.parquet` path, JSON lines for `.jsonl`, else
        the job's output format. JSONL output is copied byte for byte. Returns the path."""
        path = Path(path)
        temp = _temp_for(path)
        wanted = target_format(path, self.output_format)
        if wanted == "parquet":
            write_table(self.to_arrow(), temp)
        elif self.output_format != "parquet":
            with temp.open("wb") as out:
                for chunk in self._chunks():
                    out.write(chunk)
        else:
            with temp.open("wb") as out:
                for row in self:
                    out.write(json_line(row))
        temp.replace(path)
        return path


async def json_rows_async(chunks: AsyncIterator[bytes]) -> AsyncIterator[dict[str, Any]]:
    """`_json_rows` over an async stream of byte chunks."""
    splitter = LineSplitter()
    async for chunk in chunks:
        for row in splitter.feed(chunk):
            yield row
    for row in splitter.finish():
        yield row


def _json_rows(chunks: Iterable[bytes]) -> Iterator[dict[str, Any]]:
    splitter = LineSplitter()
    for chunk in chunks:
        yield from splitter.feed(chunk)
    yield from splitter.finish()


class AsyncResults:
    """`Results` for the async client: `async for row in results`, `await results.to_arrow()`, ..."""

    def __init__(self, transport: AsyncTransport, job_id: str, partial: bool = False) -> None:
        self._transport = transport
        self.job_id = job_id
        self._query = _query(partial)
        self._info: JobResults | None = None

    async def info(self) -> JobResults:
        if self._info is None:
            response = await self._transport.request("GET", f"/jobs/{self.job_id}/results",
                                                     params=self._query, idempotent=True)
            self._info = JobResults.model_validate(response.json())
        return self._info

    async def _direct(self) -> bool:
        info = await self.info()
        return all(readable_here(part) for part in info.parts) and (
            info.output_format != "parquet" or _has_pyarrow())

    async def _part_chunks(self, part: ResultPart) -> AsyncIterator[bytes]:
        path = local_path(part.url)
        if path is not None:
            for chunk in read_local(path):
                yield chunk
            return
        async with self._transport.stream("GET", part.url, external=True) as response:
            async for chunk in response.aiter_bytes(CHUNK_BYTES):
                yield chunk

    async def _chunks(self) -> AsyncIterator[bytes]:
        """The JSON-lines bytes of every row: the parts themselves, or the server's stream."""
        if await self._direct():
            for part in (await self.info()).parts:
                async for chunk in self._part_chunks(part):
                    yield chunk
            return
        async with self._transport.stream("GET", f"/jobs/{self.job_id}/results",
                                          params={"download": "true", **self._query}) as response:
            async for chunk in response.aiter_bytes(CHUNK_BYTES):
                yield chunk

    async def _part_tables(self) -> list[pa.Table]:
        tables = []
        for part in (await self.info()).parts:
            tables.append(parquet_table(b"".join([chunk async for chunk in self._part_chunks(part)])))
        return tables

    async def _parquet_direct(self) -> bool:
        return await self._direct() and (await self.info()).output_format == "parquet"

    async def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        if await self._parquet_direct():
            for table in await self._part_tables():
                for row in table.to_pylist():
                    yield row
            return
        async for row in json_rows_async(self._chunks()):
            yield row

    async def rows(self) -> list[dict[str, Any]]:
        return [row async for row in self]

    async def to_arrow(self) -> pa.Table:
        if await self._parquet_direct():
            return concat(await self._part_tables())
        return table_from_rows(await self.rows())

    async def to_pandas(self) -> Any:
        _require_pandas()
        return (await self.to_arrow()).to_pandas()

    async def download(self, path: str | Path) -> Path:
        path = Path(path)
        temp = _temp_for(path)
        output_format = (await self.info()).output_format
        wanted = target_format(path, output_format)
        if wanted == "parquet":
            write_table(await self.to_arrow(), temp)
        elif output_format != "parquet":
            with temp.open("wb") as out:
                async for chunk in self._chunks():
                    out.write(chunk)
        else:
            with temp.open("wb") as out:
                async for row in self:
                    out.write(json_line(row))
        temp.replace(path)
        return path

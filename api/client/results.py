"""Reading a succeeded job's output: `client.jobs.results(job)`.

Rows stream straight from the result parts (presigned S3 URLs, or `file://` paths when the store is
on this machine), part by part in input order, so the API server does not carry the bytes. When a
part cannot be read from here (a local store on another machine), or a Parquet, CSV or TSV part
without pyarrow installed, the rows come through the server's `?download=true` stream instead (JSON
lines).

    results = client.jobs.results(job)
    for row in results: ...          # dicts, in input order
    table = results.to_arrow()       # pyarrow (the `client` extra)
    frame = results.to_pandas()      # pandas, if installed
    results.download("out.parquet")  # the format follows the suffix (.parquet, .jsonl, .csv, .tsv);
                                     # else the job's output format
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
SUFFIX_FORMATS = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "jsonl", ".ndjson": "jsonl",
                  ".json": "jsonl", ".csv": "csv", ".tsv": "tsv", ".tab": "tsv"}
TABLE_FORMATS = ("parquet", "csv", "tsv")  # parts read with pyarrow; the others are JSON lines
DELIMITED_FORMATS = ("csv", "tsv")


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
    """`parquet`, `csv`, `tsv` or `jsonl`: what a download to `path` writes."""
    by_suffix = SUFFIX_FORMATS.get(path.suffix.lower())
    if by_suffix is not None:
        return by_suffix
    return output_format if output_format in TABLE_FORMATS else "jsonl"


def csv_part_rows(data: bytes, output_format: str) -> list[dict[str, Any]]:
    """A CSV or TSV part's rows as a Parquet part gives them (token counts as numbers, nested JSON
    decoded)."""
    from bulkinfer.jobs.formats.csv_parts import part_rows

    return [row for rows in part_rows(io.BytesIO(data), output_format) for row in rows]


def write_csv_table(table: pa.Table, path: Path, file_format: str) -> None:
    _pyarrow()
    from bulkinfer.jobs.formats.csv_writer import write_csv

    with path.open("wb") as out:
        write_csv(table, out, "\t" if file_format == "tsv" else ",")


def copy_csv_parts(parts: Iterable[bytes], path: Path, file_format: str) -> None:
    """CSV (or TSV) parts into one file, their text as it is, under one header row."""
    from bulkinfer.jobs.formats.csv_parts import part_tables
    from bulkinfer.jobs.formats.csv_writer import write_csv

    delimiter = "\t" if file_format == "tsv" else ","
    with path.open("wb") as out:
        first = True
        for data in parts:
            for table in part_tables(io.BytesIO(data), file_format, as_text=True):
                write_csv(table, out, delimiter, include_header=first)
                first = False


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
            info.output_format not in TABLE_FORMATS or _has_pyarrow())

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

    def _part_bytes(self) -> Iterator[bytes]:
        for part in self.info.parts:
            yield b"".join(self._part_chunks(part))

    def _part_tables(self) -> Iterator[pa.Table]:
        for data in self._part_bytes():
            yield parquet_table(data)

    def _parquet_direct(self) -> bool:
        return self._direct() and self.output_format == "parquet"

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if self._parquet_direct():
            for table in self._part_tables():
                yield from table.to_pylist()
            return
        if self.output_format in DELIMITED_FORMATS and self._direct():
            for data in self._part_bytes():
                yield from csv_part_rows(data, self.output_format)
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
        """Write every row to one file: Parquet for a `.parquet` path, JSON lines for `.jsonl`, CSV for
        `.csv`, TSV for `.tsv`, else the job's output format. JSONL output is copied byte for byte, CSV
        output to CSV cell for cell. Returns the path."""
        path = Path(path)
        temp = _temp_for(path)
        wanted = target_format(path, self.output_format)
        if wanted == "parquet":
            write_table(self.to_arrow(), temp)
        elif wanted == self.output_format and wanted in DELIMITED_FORMATS and self._direct():
            copy_csv_parts(self._part_bytes(), temp, wanted)
        elif wanted in DELIMITED_FORMATS:
            write_csv_table(self.to_arrow(), temp, wanted)
        elif self.output_format not in TABLE_FORMATS:
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
            info.output_format not in TABLE_FORMATS or _has_pyarrow())

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

    async def _part_bytes(self) -> list[bytes]:
        parts = (await self.info()).parts
        return [b"".join([chunk async for chunk in self._part_chunks(part)]) for part in parts]

    async def _part_tables(self) -> list[pa.Table]:
        return [parquet_table(data) for data in await self._part_bytes()]

    async def _parquet_direct(self) -> bool:
        return await self._direct() and (await self.info()).output_format == "parquet"

    async def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        if await self._parquet_direct():
            for table in await self._part_tables():
                for row in table.to_pylist():
                    yield row
            return
        output_format = (await self.info()).output_format
        if output_format in DELIMITED_FORMATS and await self._direct():
            for data in await self._part_bytes():
                for row in csv_part_rows(data, output_format):
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
        elif wanted == output_format and wanted in DELIMITED_FORMATS and await self._direct():
            copy_csv_parts(await self._part_bytes(), temp, wanted)
        elif wanted in DELIMITED_FORMATS:
            write_csv_table(await self.to_arrow(), temp, wanted)
        elif output_format not in TABLE_FORMATS:
            with temp.open("wb") as out:
                async for chunk in self._chunks():
                    out.write(chunk)
        else:
            with temp.open("wb") as out:
                async for row in self:
                    out.write(json_line(row))
        temp.replace(path)
        return path

"""A job's input as the caller has it, turned into what `POST /jobs` takes: an `input_uri`, or a file
to upload. In-memory rows (a pyarrow Table, a pandas DataFrame, a list of dicts) are written to a temp
file first (Parquet for tables, JSONL for dicts) and uploaded from there, so a retry can re-send them.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

# What `jobs.create(input=...)` accepts.
InputSource = Any  # str | Path | IO[bytes] | pyarrow.Table | pandas.DataFrame | list[dict]


class Upload:
    """A file on its way to `POST /jobs` (multipart); `files()` rewinds it, so each attempt sends it whole."""

    def __init__(self, stream: IO[bytes], filename: str, *, owned: bool) -> None:
        self.stream = stream
        self.filename = filename
        self._owned = owned  # opened here: closed here
        try:
            self._start: int | None = stream.tell() if stream.seekable() else None
        except (AttributeError, OSError, ValueError):
            self._start = None

    @property
    def rewindable(self) -> bool:
        return self._start is not None

    def files(self) -> dict[str, Any]:
        if self._start is not None:
            self.stream.seek(self._start)
        return {"file": (self.filename, self.stream, "application/octet-stream")}

    def close(self) -> None:
        if self._owned:
            self.stream.close()

    def __enter__(self) -> Upload:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


def is_uri(value: str) -> bool:
    """`s3://…` and `file://…` name an object the server reads itself; any other string is a local file."""
    return "://" in value


def prepare_upload(source: InputSource, filename: str | None = None) -> Upload:
    """An `Upload` for anything but a URI (see `is_uri`)."""
    if isinstance(source, str | Path):
        path = Path(source).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"input {str(source)!r} is not a file (use s3://bucket/key for an object "
                                    "in S3)")
        return Upload(path.open("rb"), filename or path.name, owned=True)
    if hasattr(source, "read"):
        return Upload(source, filename or Path(str(getattr(source, "name", "input"))).name, owned=False)
    if _is_from(source, "pyarrow"):
        return _parquet_upload(source, filename)
    if _is_from(source, "pandas"):
        import pyarrow as pa  # the `client` extra

        return _parquet_upload(pa.Table.from_pandas(source, preserve_index=False), filename)
    if isinstance(source, Sequence) and not isinstance(source, bytes | bytearray):
        return _jsonl_upload(source, filename)
    raise TypeError(f"cannot use a {type(source).__name__} as a job's input: give an s3:// URI, a file path, "
                    "a binary file object, a pyarrow Table, a pandas DataFrame or a list of dicts")


def _is_from(value: object, package: str) -> bool:
    return type(value).__module__.split(".")[0] == package and hasattr(value, "columns")


def _parquet_upload(table: Any, filename: str | None) -> Upload:
    import pyarrow.parquet as pq

    stream = tempfile.TemporaryFile()
    pq.write_table(table, stream)
    stream.seek(0)
    return Upload(stream, filename or "input.parquet", owned=True)


def _jsonl_upload(rows: Sequence[Any], filename: str | None) -> Upload:
    stream = tempfile.TemporaryFile()
    for index, row in enumerate(rows):
        if not isinstance(row, Mapping):
            stream.close()
            raise TypeError(f"row {index} of the input is a {type(row).__name__}, not a dict")
        try:
            stream.write(json.dumps(row, ensure_ascii=False).encode() + b"\n")
        except TypeError as error:
            stream.close()
            raise TypeError(f"row {index} of the input is not JSON-serialisable: {error}") from None
    stream.seek(0)
    return Upload(stream, filename or "input.jsonl", owned=True)

"""Input format detection: from the name, else from the first bytes and the first line."""

from __future__ import annotations

from bulkinfer.jobs.errors import InputError
from bulkinfer.jobs.formats.json_text import UnreadableJson, loads_untrusted
from bulkinfer.jobs.formats.lines import iter_lines_in_range
from bulkinfer.jobs.object_store.base import ObjectStore
from bulkinfer.jobs.spec import DELIMITED_FORMATS, InputFormat, JobSpec, file_name, format_from_name

PARQUET_MAGIC = b"PAR1"
# Enough to hold the first line of any sane JSONL file; a longer one is read no further.
FIRST_LINE_LIMIT = 4 << 20


def detect_input_format(store: ObjectStore, key: str) -> InputFormat:
    """CSV and TSV by name; Parquet by name or magic bytes; JSONL whose first line has `custom_id`
    and `body` is OpenAI batch; other JSONL is JSONL. Raises `InputError` when none fits.
    """
    by_name = format_from_name(key)
    if by_name in DELIMITED_FORMATS:
        return by_name
    if by_name == InputFormat.PARQUET or store.read_range(key, 0, 4) == PARQUET_MAGIC:
        return InputFormat.PARQUET
    first = _first_non_blank_line(store, key)
    try:
        record = loads_untrusted(first) if first is not None else None
    except UnreadableJson:
        record = None
    if isinstance(record, dict) and "custom_id" in record and "body" in record:
        return InputFormat.OPENAI_BATCH
    if by_name == InputFormat.JSONL or isinstance(record, dict):
        return InputFormat.JSONL
    raise InputError(f"cannot tell the format of {file_name(key)}: name it .parquet, .jsonl, .csv or .tsv, "
                     "or set input_format")


def _first_non_blank_line(store: ObjectStore, key: str) -> bytes | None:
    for line in iter_lines_in_range(store, key, 0, FIRST_LINE_LIMIT, max_line_bytes=FIRST_LINE_LIMIT):
        if line.data.strip():
            return line.data
    return None


def resolve_spec(spec: JobSpec, store: ObjectStore, key: str) -> JobSpec:
    """The spec with `input_format` detected (if omitted) and `output_format` defaulted,
    revalidated: what the API stores as job.json. Raises pydantic's ValidationError if the
    detected format does not fit the column mapping, `InputError` if the input is unreadable.
    """
    input_format = spec.input_format or detect_input_format(store, key)
    return spec.with_formats(input_format)

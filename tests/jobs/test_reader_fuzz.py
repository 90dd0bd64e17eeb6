"""Fuzzing the readers: arbitrary bytes in a JSONL line and arbitrary values in a Parquet cell never
fail the job; each bad row is one row error and every good row is read once (tests/jobs/reader_fuzz.py;
run it as a module for a longer campaign)."""

from __future__ import annotations

import pyarrow as pa
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

from bulkinfer.jobs.object_store.local import LocalObjectStore
from tests.jobs.reader_fuzz import (
    GOOD_ROWS,
    Unwritable,
    check_jsonl_line,
    check_parquet_cell,
    fuzz_lines,
    parquet_cells,
)

BOUNDED = settings(max_examples=300, deadline=None, derandomize=True, database=None,
                   suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@BOUNDED
@given(line=fuzz_lines, position=st.integers(0, GOOD_ROWS), openai=st.booleans())
def test_any_bytes_in_a_jsonl_line_are_that_rows_error_only(tmp_path, line: bytes, position: int,
                                                            openai: bool) -> None:
    check_jsonl_line(LocalObjectStore(tmp_path), line, position, openai)


@BOUNDED
@given(cell=parquet_cells, position=st.integers(0, GOOD_ROWS))
def test_any_value_in_a_parquet_cell_is_that_rows_error_only(tmp_path, cell: tuple[str, pa.DataType, object],
                                                             position: int) -> None:
    try:
        check_parquet_cell(LocalObjectStore(tmp_path), *cell, position)
    except Unwritable:  # Arrow cannot write such a file, so no job can be given one
        reject()

"""Fuzzing the readers: arbitrary bytes in a JSONL line, a CSV cell or a CSV record, and arbitrary
values in a Parquet cell never fail the job; each bad row is one row error and every good row is read
once (tests/jobs/reader_fuzz.py; run it as a module for a longer campaign)."""

from __future__ import annotations

import pyarrow as pa
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

from bulkinfer.jobs.object_store.local import LocalObjectStore
from tests.jobs.reader_fuzz import (
    GOOD_ROWS,
    Unwritable,
    check_csv_cell,
    check_csv_record,
    check_jsonl_line,
    check_parquet_cell,
    csv_cells,
    csv_records,
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

# A CSV example reads the file four times (plan, dedup scan, estimate, shards) through pyarrow calls of
# ~0.3 ms each: fewer examples, for the same time as the others.
CSV_BOUNDED = settings(BOUNDED, max_examples=150)


@CSV_BOUNDED
@given(cell=csv_cells, position=st.integers(0, GOOD_ROWS))
def test_any_bytes_in_a_quoted_csv_cell_read_back_as_written_or_are_that_rows_error(tmp_path, cell: bytes,
                                                                                    position: int) -> None:
    check_csv_cell(LocalObjectStore(tmp_path), cell, position)


@CSV_BOUNDED
@given(record=csv_records, position=st.integers(0, GOOD_ROWS))
def test_any_bytes_as_a_csv_record_are_that_rows_error_only(tmp_path, record: bytes, position: int) -> None:
    check_csv_record(LocalObjectStore(tmp_path), record, position)

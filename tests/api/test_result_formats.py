"""What a results download writes, chosen by the file's name: the SDK's format rules, without a server."""

from __future__ import annotations

import csv
from pathlib import Path

import pyarrow as pa
import pytest

from bulkinfer.api.client.results import target_format, write_csv_table


@pytest.mark.parametrize("name, output_format, wanted", [
    ("out.CSV", "parquet", "csv"), ("out.tsv", "jsonl", "tsv"), ("out.tab", "csv", "tsv"),
    ("out.parquet", "csv", "parquet"), ("out.jsonl", "csv", "jsonl"),
    ("out", "csv", "csv"), ("out", "tsv", "tsv"), ("out", "openai_batch", "jsonl"),
])
def test_the_name_chooses_the_format_else_the_jobs_own(name: str, output_format: str, wanted: str) -> None:
    assert target_format(Path(name), output_format) == wanted


def test_rows_written_as_csv_hold_nested_values_as_json_text(tmp_path: Path) -> None:
    table = pa.table({"id": ["1", "2"], "text": ["a, \"b\"\nc", None],
                      "logprobs": pa.array([[{"token": "a", "bytes": b"a"}], None])})
    write_csv_table(table, tmp_path / "rows.tsv", "tsv")
    with (tmp_path / "rows.tsv").open(newline="") as file:
        assert list(csv.reader(file, delimiter="\t")) == [
            ["id", "text", "logprobs"], ["1", 'a, "b"\nc', '[{"token": "a", "bytes": [97]}]'], ["2", "", ""]]

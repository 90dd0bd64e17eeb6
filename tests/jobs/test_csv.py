"""CSV and TSV input: header row, quoting, encodings; shards planned at record starts and each read
by its own byte range; a row pyarrow cannot read is that row's error."""

from __future__ import annotations

import csv
import io
import json

import pyarrow as pa
import pyarrow.csv as pa_csv
import pytest

from bulkinfer.jobs.errors import InputError
from bulkinfer.jobs.formats.csv_header import HEADER_CHUNK_BYTES
from bulkinfer.jobs.formats.csv_records import iter_records
from bulkinfer.jobs.formats.detect import resolve_spec
from bulkinfer.jobs.formats.lines import READ_CHUNK_BYTES
from bulkinfer.jobs.formats.readers import read_shard_rows
from bulkinfer.jobs.formats.rows import Row, RowError
from bulkinfer.jobs.planning.sharding import plan_shards
from bulkinfer.jobs.spec import JobSpec

SPEC = JobSpec(input_uri="/in/rows.csv", model="m", prompt_column="question", id_column="id",
               passthrough_columns=["team"], shard_size=2)
# Every kind of cell a spreadsheet writes: a BOM, quoted commas, doubled quotes, a newline inside a
# value, CRLF line ends, a blank line, an empty cell, an id that is only digits with a leading zero.
TRICKY = ('\ufeffid,question,team\r\n'
          '007,"What is 2+2, really?",red\r\n'
          '8,"She said ""hi""\nthen left",\r\n'
          '\r\n'
          '9,a row with,one field,too many\r\n'
          '10,,blue\r\n'
          '11,plain,green').encode()


def resolved(spec: JobSpec, store, key: str) -> JobSpec:
    return resolve_spec(spec.model_copy(update={"input_uri": f"/in/{key}"}), store, key)


def read_all(store, key: str, spec: JobSpec) -> list[Row | RowError]:
    shards = plan_shards(store, key, spec)
    return [item for shard in shards for item in read_shard_rows(store, key, spec, shard)]


def test_quoted_fields_crlf_a_bom_and_blank_lines_read_as_a_spreadsheet_shows_them(store) -> None:
    store.put_bytes("rows.csv", TRICKY)
    spec = resolved(SPEC, store, "rows.csv")
    assert (spec.input_format, spec.output_format) == ("csv", "csv")  # by the name; output follows
    items = read_all(store, "rows.csv", spec)
    assert [item.index for item in items] == [0, 1, 2, 3, 4]  # data rows, numbered from 0
    first, second, too_many, no_question, last = items
    assert isinstance(first, Row) and (first.row_id, first.prompt) == ("007", "What is 2+2, really?")
    assert first.passthrough == {"team": "red"}
    assert isinstance(second, Row) and second.prompt == 'She said "hi"\nthen left'
    assert second.passthrough == {"team": None}  # an empty cell is null
    assert isinstance(too_many, RowError) and too_many.code == "invalid_row"
    assert too_many.message.startswith("the row at byte ") and "Expected 3 columns, got 4" in too_many.message
    assert isinstance(no_question, RowError) and no_question.code == "missing_column"
    assert no_question.row_id == "10" and no_question.passthrough == {"team": "blue"}
    assert isinstance(last, Row) and (last.row_id, last.prompt) == ("11", "plain")  # no final line end


def test_shards_cut_at_record_starts_read_every_row_once_whatever_the_quoting(local_store) -> None:
    rows = [[f"r{n}", f"line one of {n}\nline two, with \"quotes\"\r\nand three" if n % 3 else f"q{n}", "t"]
            for n in range(25)]
    text = io.StringIO()
    csv.writer(text).writerows([["id", "question", "team"], *rows])
    local_store.put_bytes("rows.csv", text.getvalue().encode())
    spec = resolved(SPEC.model_copy(update={"shard_size": 4}), local_store, "rows.csv")
    shards = plan_shards(local_store, "rows.csv", spec)
    assert [(s.row_start, s.row_end, s.estimated_rows) for s in shards] == [
        (n, min(n + 4, 25), min(4, 25 - n)) for n in range(0, 25, 4)]
    items = [item for shard in shards for item in read_shard_rows(local_store, "rows.csv", spec, shard)]
    assert [(item.index, item.row_id, item.prompt) for item in items] == [
        (n, row[0], row[1]) for n, row in enumerate(rows)]


def test_a_shard_streams_only_its_own_byte_range(s3_store) -> None:
    rows = "".join(f'{n},"question {n}, padded {"x" * 200}",t\n' for n in range(40_000))
    data = ("id,question,team\n" + rows).encode()  # ~9 MiB
    s3_store.put_bytes("rows.csv", data)
    spec = resolved(SPEC.model_copy(update={"shard_size": 10_000}), s3_store, "rows.csv")
    shards = plan_shards(s3_store, "rows.csv", spec)
    assert len(shards) == 4
    reads: list[tuple[int, int]] = []
    real_open_read = s3_store.open_read

    def counting_open_read(key: str, start: int = 0):
        stream = real_open_read(key, start)
        real_read = stream.read

        def read(size: int = -1) -> bytes:
            chunk = real_read(size)
            reads.append((start, len(chunk)))
            return chunk
        stream.read = read
        return stream

    s3_store.open_read = counting_open_read
    shard = shards[2]
    items = list(read_shard_rows(s3_store, "rows.csv", spec, shard))
    assert [item.row_id for item in items] == [str(n) for n in range(20_000, 30_000)]
    from_range = sum(size for start, size in reads if start == shard.byte_start)
    from_header = sum(size for start, size in reads if start == 0)
    assert {start for start, _ in reads} == {0, shard.byte_start}  # the header, then its own rows
    own = shard.byte_end - shard.byte_start
    assert own <= from_range <= own + READ_CHUNK_BYTES  # its range, then at most one chunk past it
    assert from_header <= HEADER_CHUNK_BYTES  # the header row, not the rows before the shard


def test_tsv_and_a_windows_1252_file_with_csv_encoding(local_store) -> None:
    text = "id\tquestion\tteam\n1\tcaf\u00e9 \u201cs\u00fcd\u201d\tx\n"
    local_store.put_bytes("rows.tsv", text.encode("cp1252"))
    spec = resolved(SPEC.model_copy(update={"csv_encoding": "Windows-1252"}), local_store, "rows.tsv")
    assert (spec.input_format, spec.csv_encoding) == ("tsv", "cp1252")
    [row] = read_all(local_store, "rows.tsv", spec)
    assert isinstance(row, Row) and row.prompt == "caf\u00e9 \u201cs\u00fcd\u201d"


def test_text_that_is_not_utf8_fails_its_row_and_says_which_setting_fixes_it(local_store) -> None:
    local_store.put_bytes("rows.csv", b"id,question,team\n1,ok,x\n2,caf\xe9,x\n3,fine,x\n")
    items = read_all(local_store, "rows.csv", resolved(SPEC, local_store, "rows.csv"))
    assert [type(item).__name__ for item in items] == ["Row", "RowError", "Row"]
    assert "not UTF-8" in items[1].message and "csv_encoding" in items[1].message


def test_a_quote_never_closed_is_its_rows_error_and_the_rows_after_it_run(local_store) -> None:
    local_store.put_bytes("rows.csv", b'id,question,team\n1,"never closed,x\n2,fine,x\n')
    items = read_all(local_store, "rows.csv", resolved(SPEC, local_store, "rows.csv"))
    assert isinstance(items[0], RowError) and "quoted field is not closed" in items[0].message
    assert isinstance(items[1], Row) and items[1].prompt == "fine"


def test_a_messages_column_holds_the_chat_as_json_text(local_store) -> None:
    chat = json.dumps([{"role": "user", "content": "Hi, there"}])
    text = io.StringIO()
    csv.writer(text).writerows([["id", "chat"], ["c1", chat]])
    local_store.put_bytes("chats.csv", text.getvalue().encode())
    spec = resolved(JobSpec(input_uri="/in/chats.csv", model="m", messages_column="chat"), local_store,
                    "chats.csv")
    [row] = read_all(local_store, "chats.csv", spec)
    assert isinstance(row, Row) and row.messages == [{"role": "user", "content": "Hi, there"}]


@pytest.mark.parametrize("data", [b"What is 2+2?,red\nWhy?,blue\n", b"id,prompt,team\n1,x,y\n"])
def test_a_header_without_the_mapped_column_is_refused_naming_it(local_store, data: bytes) -> None:
    local_store.put_bytes("rows.csv", data)  # no header at all, or one without `question`
    with pytest.raises(InputError) as error:
        spec = resolved(SPEC.model_copy(update={"id_column": None}), local_store, "rows.csv")
        plan_shards(local_store, "rows.csv", spec)
    assert str(error.value).startswith("column 'question' is not in the header row of the file (its columns:")
    assert "a CSV file's first row must name its columns" in str(error.value)


def test_records_are_the_rows_pyarrow_reads(local_store) -> None:
    """The planner's record starts agree with pyarrow's own parse of the whole file."""
    cells = ['"a""b"', 'x"y', '"multi\r\nline"', "", '""', '"q"tail', "  ", '"with, comma"']
    lines = [f"{cells[n % len(cells)]},{n}" for n in range(60)]
    data = ("h1,h2\n" + "\r\n".join(lines) + "\n").encode()
    local_store.put_bytes("rows.csv", data)
    records = list(iter_records(local_store, "rows.csv", 6, len(data), b","))
    table = pa_csv.read_csv(io.BytesIO(data), parse_options=pa_csv.ParseOptions(newlines_in_values=True),
                            convert_options=pa_csv.ConvertOptions(column_types={"h2": pa.int64()}))
    assert len(records) == table.num_rows == 60
    assert table.column("h2").to_pylist() == list(range(60))

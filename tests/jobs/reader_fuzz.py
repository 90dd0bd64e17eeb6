"""The readers' promise under arbitrary input, as hypothesis strategies and one property per format.

The property: reading a job's input as the planner and the workers do (format detection, the shard
plan, the OpenAI custom_id scan, the cross-shard dedup scan, a dry run's estimate, each shard's
rows) never raises; a bad row becomes exactly one row error in its place, and every good row is
read exactly once, as a row.

Used by tests/jobs/test_reader_fuzz.py (a bounded run in the suite) and as a campaign from the
command line, which prints how many inputs it tried and how many broke the promise:

    PYTHONPATH=$PWD python -m tests.jobs.reader_fuzz --examples 20000
"""

from __future__ import annotations

import argparse
import io
import json
import tempfile
import traceback
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bulkinfer.jobs.formats.detect import detect_input_format
from bulkinfer.jobs.formats.readers import read_shard_rows
from bulkinfer.jobs.formats.rows import Row, RowError
from bulkinfer.jobs.object_store.local import LocalObjectStore
from bulkinfer.jobs.planning.estimate import estimate_job
from bulkinfer.jobs.planning.job_dedup import mark_copies
from bulkinfer.jobs.planning.sharding import plan_shards
from bulkinfer.jobs.spec import JobSpec

GOOD_ROWS = 6
JSONL_SPEC = JobSpec(input_uri="s3://b/rows.jsonl", input_format="jsonl", model="m", id_column="id",
                     template="Q: {question}", sampling_column="sampling", response_format_column="format",
                     passthrough_columns=["extra"], sampling={"temperature": 0.0}, shard_size=2)
OPENAI_SPEC = JobSpec(input_uri="s3://b/rows.jsonl", input_format="openai_batch", model="m", shard_size=2,
                      sampling={"temperature": 0.0})
PARQUET_SPEC = JobSpec(input_uri="s3://b/rows.parquet", input_format="parquet", model="m", id_column="id",
                       prompt_column="question", sampling_column="sampling", passthrough_columns=["extra"],
                       sampling={"temperature": 0.0}, shard_size=2)
CSV_SPEC = JobSpec(input_uri="s3://b/rows.csv", input_format="csv", model="m", id_column="id",
                   prompt_column="question", passthrough_columns=["extra"], sampling={"temperature": 0.0},
                   shard_size=2)

# Values that have broken JSON readers: deep nesting, numbers past Python's int limit, escapes of
# half a UTF-16 pair, bytes that are not UTF-8, and every JSON type where a field expects another.
_leaves = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20), st.sampled_from(["\ud800", "\udfff\ud800", "\x00", "\u2028", "{x}", "}{"]))
_json_values = st.recursive(_leaves, lambda inner: st.lists(inner, max_size=3)
                            | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=12)


@st.composite
def _extreme_json_text(draw: st.DrawFn) -> bytes:
    depth = draw(st.sampled_from([99, 100, 101, 990, 1000, 5000, 100_000]))
    opener, closer = draw(st.sampled_from([("[", "]"), ('{"a":', "}")]))
    closed = draw(st.booleans())
    nested = opener * depth + "1" + (closer * depth if closed else "")
    digits = draw(st.sampled_from([4300, 4301, 10_000]))
    number = draw(st.sampled_from(["1" * digits, "-" + "9" * digits, "1e" + "9" * digits,
                                   "0." + "1" * digits]))
    field = draw(st.sampled_from(["question", "sampling", "format", "id", "extra"]))
    value = draw(st.sampled_from([nested, number, '"\\ud800"', '"\\udc00\\ud800"']))
    return f'{{"id": "fuzz", "question": "q", "{field}": {value}}}'.encode()


@st.composite
def _object_line(draw: st.DrawFn) -> bytes:
    record = draw(st.dictionaries(st.sampled_from(["id", "question", "sampling", "format", "extra",
                                                   "custom_id", "url", "body", "method"]), _json_values,
                                  max_size=6))
    text = json.dumps(record)
    if draw(st.booleans()):  # break it somewhere
        cut = draw(st.integers(0, len(text)))
        text = text[:cut] + draw(st.sampled_from(["", "\xff", "\\", '"', "]", "\\ud800", "\t"])) + text[cut:]
    return text.encode("utf-8", "surrogatepass")


fuzz_lines = st.one_of(st.binary(max_size=200), _extreme_json_text(), _object_line()).map(
    lambda line: line.replace(b"\n", b""))  # a line holds no newline: that would make two lines


def _good_jsonl_line(n: int) -> bytes:
    return json.dumps({"id": f"good{n}", "question": f"q{n}", "extra": n}).encode()


def _good_openai_line(n: int) -> bytes:
    return json.dumps({"custom_id": f"good{n}", "method": "POST", "url": "/v1/chat/completions",
                       "body": {"messages": [{"role": "user", "content": f"q{n}"}]}}).encode()


@dataclass
class Outcome:
    """What reading one input gave: its rows and errors by id, for the property to check."""

    rows: list[str]
    errors: int


def _read_everything(store: LocalObjectStore, key: str, spec: JobSpec) -> list[Row | RowError]:
    """Every path that reads the rows, as the API and the workers call them; the shard rows."""
    plan = plan_shards(store, key, spec)
    marked = mark_copies(store, key, spec.model_copy(update={"deduplicate": True}), plan)
    estimate_job(store, key, spec, marked, tokenizer=None, measured=[], live_workers=0)
    return [item for shard in marked for item in read_shard_rows(store, key, spec, shard)]


def check_jsonl_line(store: LocalObjectStore, line: bytes, position: int, openai: bool) -> None:
    """One arbitrary line among good ones (JSONL or OpenAI batch): the property holds."""
    good = [(_good_openai_line if openai else _good_jsonl_line)(n) for n in range(GOOD_ROWS)]
    lines = good[:position] + [line] + good[position:]
    key = "rows.jsonl"
    store.put_bytes(key, b"\n".join(lines) + b"\n")
    detect_input_format(store, key)
    items = _read_everything(store, key, OPENAI_SPEC if openai else JSONL_SPEC)
    fuzz_offset = sum(len(text) + 1 for text in lines[:position])
    fuzz_items = [item for item in items if item.index == fuzz_offset]
    good_items = [item for item in items if item.index != fuzz_offset]
    is_blank = not line.removeprefix(b"\xef\xbb\xbf" if position == 0 else b"").strip()
    assert len(fuzz_items) == (0 if is_blank else 1), (line, fuzz_items)
    expected = [f"good{n}" for n in range(GOOD_ROWS)]
    taken = _custom_id(line) if openai else None
    if taken in expected[position:]:  # the fuzz line used a later good line's custom_id first
        expected.remove(taken)
    assert [item.row_id for item in good_items if isinstance(item, Row)] == expected, good_items
    assert [item.index for item in items] == sorted(item.index for item in items)


def _custom_id(line: bytes) -> str | None:
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):
        return None
    return record.get("custom_id") if isinstance(record, dict) else None


# A Parquet cell of every kind a file can hold, with values Python cannot always represent.
_string_bytes = st.binary(max_size=40)
parquet_cells = st.one_of(
    st.tuples(st.just("question"), st.just(pa.string()), _string_bytes),
    st.tuples(st.just("sampling"), st.just(pa.string()), st.one_of(_string_bytes, _extreme_json_text())),
    st.tuples(st.just("id"), st.just(pa.string()), _string_bytes),
    st.tuples(st.just("extra"), st.sampled_from([pa.string(), pa.large_string(), pa.binary()]),
              _string_bytes),
    st.tuples(st.just("extra"), st.sampled_from([pa.int64(), pa.timestamp("s"), pa.timestamp("ms"),
                                                 pa.timestamp("us"), pa.timestamp("ns"), pa.date64(),
                                                 pa.duration("s")]), st.integers(-(2**63), 2**63 - 1)),
    st.tuples(st.just("extra"), st.sampled_from([pa.date32(), pa.time32("s"), pa.int32()]),
              st.integers(-(2**31), 2**31 - 1)),
    st.tuples(st.just("extra"), st.just(pa.float64()), st.floats()),
    st.tuples(st.just("extra"), st.just(pa.list_(pa.string())), st.lists(_string_bytes, max_size=3)),
    st.tuples(st.just("extra"), st.just(pa.decimal128(38, 5)), st.integers(-(10**37), 10**37)),
)


def _cell_array(kind: pa.DataType, values: list) -> pa.Array:
    """An Arrow array of `kind` holding `values` as raw bits (strings are not checked for UTF-8)."""
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        raw = pa.large_binary() if pa.types.is_large_string(kind) else pa.binary()
        return pa.array(values, raw).view(kind)
    if pa.types.is_list(kind):
        return pa.array(values, pa.list_(pa.binary())).view(kind)
    if pa.types.is_decimal(kind):
        from decimal import Decimal
        return pa.array([None if v is None else Decimal(v).scaleb(-5) for v in values], kind)
    if pa.types.is_temporal(kind) and not pa.types.is_date32(kind):
        bits = pa.int32() if pa.types.is_time32(kind) else pa.int64()
        return pa.array(values, bits).view(kind)
    if pa.types.is_date32(kind):
        return pa.array(values, pa.int32()).view(kind)
    return pa.array(values, kind)


class Unwritable(Exception):
    """Arrow refuses to write this cell to Parquet (e.g. seconds past int64 milliseconds): no input."""


def parquet_with_cell(column: str, kind: pa.DataType, value: object, position: int) -> bytes:
    """A good Parquet file of GOOD_ROWS + 1 rows with `value` in `column` at `position`."""
    rows = GOOD_ROWS + 1
    good = {"id": [f"good{n}" for n in range(rows)], "question": [f"q{n}" for n in range(rows)],
            "sampling": [None] * rows, "extra": [None] * rows}
    good_kinds = {"id": pa.string(), "question": pa.string(), "sampling": pa.string(), "extra": kind}
    values = list(good[column])
    values[position] = value
    good[column] = values
    table = pa.table({name: _cell_array(kind if name == column else good_kinds[name], good[name])
                      for name in good})
    buffer = io.BytesIO()
    try:
        pq.write_table(table, buffer, row_group_size=3)
    except pa.ArrowInvalid as error:
        raise Unwritable(str(error)) from None
    return buffer.getvalue()


def check_parquet_cell(store: LocalObjectStore, column: str, kind: pa.DataType, value: object,
                       position: int) -> None:
    """One arbitrary cell in an otherwise good Parquet file: the property holds."""
    key = "rows.parquet"
    store.put_bytes(key, parquet_with_cell(column, kind, value, position))
    items = _read_everything(store, key, PARQUET_SPEC)
    assert [item.index for item in items] == list(range(GOOD_ROWS + 1))  # one item per row, once, in order
    for item in items:
        if item.index != position:
            assert isinstance(item, Row) and item.row_id == f"good{item.index}", item


# Any bytes as one CSV cell, quoted as a CSV writer quotes it; or as a whole record, unquoted.
csv_cells = st.binary(max_size=60)
csv_records = st.binary(max_size=60).map(lambda record: record.replace(b"\r", b"").replace(b"\n", b""))


def _good_csv_record(n: int) -> bytes:
    return f"good{n},q{n},{n}".encode()


def check_csv(store: LocalObjectStore, record: bytes, position: int, cell: bytes | None) -> None:
    """One arbitrary record (or one whose question is an arbitrary quoted cell) among good ones: the
    property holds, and a cell that is text reads back as exactly that text."""
    good = [_good_csv_record(n) for n in range(GOOD_ROWS)]
    records = [b"id,question,extra", *good[:position], record, *good[position:]]
    key = "rows.csv"
    store.put_bytes(key, b"\r\n".join(records) + b"\r\n")
    items = _read_everything(store, key, CSV_SPEC)
    expected = [f"good{n}" for n in range(GOOD_ROWS)]
    if not record:  # an empty line is no row
        assert [item.row_id for item in items] == expected and all(isinstance(i, Row) for i in items), items
        return
    assert [item.index for item in items] == list(range(GOOD_ROWS + 1))  # one item per row, once, in order
    others = [item for item in items if item.index != position]
    assert [item.row_id for item in others if isinstance(item, Row)] == expected, items
    if cell is not None and cell:
        fuzz = items[position]
        try:
            text = cell.decode()
        except UnicodeDecodeError:
            assert isinstance(fuzz, RowError), fuzz
        else:
            assert isinstance(fuzz, Row) and fuzz.prompt == text, (cell, fuzz)


def check_csv_cell(store: LocalObjectStore, cell: bytes, position: int) -> None:
    quoted = b'"' + cell.replace(b'"', b'""') + b'"'
    check_csv(store, b"fuzz," + quoted + b",x", position, cell)


def check_csv_record(store: LocalObjectStore, record: bytes, position: int) -> None:
    check_csv(store, record, position, None)


class Campaign:
    """Counts inputs tried and promise failures (an exception out of a reader, or a property miss)."""

    def __init__(self, store: LocalObjectStore) -> None:
        self.store = store
        self.tried = 0
        self.unwritable = 0
        self.failures: list[str] = []

    def attempt(self, check, *args) -> None:  # noqa: ANN001 - one of the check_* functions
        self.tried += 1
        try:
            check(self.store, *args)
        except Unwritable:  # no such file can exist: not an input
            self.tried -= 1
            self.unwritable += 1
        except Exception:  # noqa: BLE001 - each is a broken promise, counted and shown
            self.failures.append(f"{check.__name__}{args!r:.300}\n{traceback.format_exc(limit=6)}")


def run_campaign(examples: int, seed: int = 0) -> Campaign:
    campaign = Campaign(LocalObjectStore(tempfile.mkdtemp(prefix="reader-fuzz-")))
    quiet = settings(max_examples=examples, deadline=None, database=None, derandomize=seed == 0,
                     suppress_health_check=list(HealthCheck))

    @quiet
    @given(fuzz_lines, st.integers(0, GOOD_ROWS), st.booleans())
    def jsonl(line: bytes, position: int, openai: bool) -> None:
        campaign.attempt(check_jsonl_line, line, position, openai)

    @quiet
    @given(parquet_cells, st.integers(0, GOOD_ROWS))
    def parquet(cell: tuple, position: int) -> None:
        campaign.attempt(check_parquet_cell, *cell, position)

    @quiet
    @given(csv_cells, st.integers(0, GOOD_ROWS))
    def csv_cell(cell: bytes, position: int) -> None:
        campaign.attempt(check_csv_cell, cell, position)

    @quiet
    @given(csv_records, st.integers(0, GOOD_ROWS))
    def csv_record(record: bytes, position: int) -> None:
        campaign.attempt(check_csv_record, record, position)

    jsonl()
    parquet()
    csv_cell()
    csv_record()
    return campaign


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=5000,
                        help="inputs per format (JSONL lines, Parquet cells, CSV cells and records)")
    args = parser.parse_args()
    campaign = run_campaign(args.examples)
    for failure in campaign.failures[:5]:
        print(failure)
    print(f"inputs tried {campaign.tried}, job failures {len(campaign.failures)} "
          f"({campaign.unwritable} drawn cells Arrow cannot write to Parquet were not inputs)")
    raise SystemExit(1 if campaign.failures else 0)


if __name__ == "__main__":
    main()

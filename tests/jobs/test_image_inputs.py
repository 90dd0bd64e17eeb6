"""Images from user input into rows: every reader gives them as OpenAI `image_url` parts of the row's
messages (or its `as_chat` user turn), and a malformed, unreadable-form, too big or too many image is
that row's error (`invalid_row` for a bad shape, `invalid_image` otherwise), never the job's."""

from __future__ import annotations

import base64
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from bulkinfer.jobs import settings as settings_module
from bulkinfer.jobs.formats.openai_batch import iter_openai_batch_rows
from bulkinfer.jobs.formats.readers import read_shard_rows
from bulkinfer.jobs.formats.rows import Row, RowBuilder, RowError, RowErrorCode
from bulkinfer.jobs.image_limits import ImageLimits
from bulkinfer.jobs.planning.sharding import plan_shards
from bulkinfer.jobs.settings import Settings
from bulkinfer.jobs.spec import JobSpec

PNG = b"\x89PNG\r\n\x1a\n fake bytes: readers never decode"
DATA_URL = "data:image/png;base64," + base64.b64encode(PNG).decode()
BATCH = JobSpec(input_uri="/in/batch.jsonl", input_format="openai_batch", model="tiny")
PLAIN = JobSpec(input_uri="/in/rows.jsonl", input_format="jsonl", model="tiny", prompt_column="q",
                image_column="img")


def image(url: object, **extra: object) -> dict:
    return {"type": "image_url", "image_url": url, **extra}


def chat_line(custom_id: str, content: object, role: str = "user") -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": role, "content": content}]}}


def messages_line(custom_id: str, *blocks: dict) -> dict:
    body = {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": list(blocks)}]}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/messages", "body": body}


def read_batch(store, lines: list[dict], limits: ImageLimits | None = None) -> list[Row | RowError]:
    data = b"".join(json.dumps(item).encode() + b"\n" for item in lines)
    store.put_bytes("batch.jsonl", data)
    return list(iter_openai_batch_rows(store, "batch.jsonl", 0, len(data), BATCH, limits=limits))


# ------------------------------------------------------------------------------- OpenAI lines


def test_image_url_parts_of_a_chat_line_keep_their_order_in_the_object_form(local_store) -> None:
    text = {"type": "text", "text": "Compare these."}
    [row] = read_batch(local_store, [chat_line("a", [
        text, image("https://img.example.com/a.png"), image({"url": "s3://pics/b.jpg", "detail": "low"}),
        image({"url": DATA_URL, "detail": None})])])
    assert isinstance(row, Row)
    assert row.messages == [{"role": "user", "content": [
        text, {"type": "image_url", "image_url": {"url": "https://img.example.com/a.png"}},
        {"type": "image_url", "image_url": {"url": "s3://pics/b.jpg", "detail": "low"}},
        {"type": "image_url", "image_url": {"url": DATA_URL}}]}]


@pytest.mark.parametrize(("content", "role", "code", "message"), [
    ([{"type": "text", "text": "x"}, image({"url": 5})], "user", RowErrorCode.INVALID_ROW,
     "body.messages[0].content[1].image_url.url must be a string"),
    ([image({"detail": "low"})], "user", RowErrorCode.INVALID_ROW,
     "body.messages[0].content[0].image_url.url must be a string"),
    ([image(7)], "user", RowErrorCode.INVALID_ROW,
     "body.messages[0].content[0].image_url must be an object ({url, detail}) or a URL string"),
    ([image({"url": DATA_URL, "detail": "ultra"})], "user", RowErrorCode.INVALID_ROW,
     "body.messages[0].content[0].image_url.detail must be one of auto, low, high"),
    ([image(DATA_URL)], "assistant", RowErrorCode.INVALID_ROW,
     "body.messages[0].content[0] is an image: only user messages may hold images"),
    ([image("ftp://host/a.png")], "user", RowErrorCode.INVALID_IMAGE,
     "body.messages[0].content[0].image_url.url: ftp://host/a.png is not an image location this server "
     "reads; give a data: URL (data:<type>;base64,...), s3://bucket/key, an absolute path or file:// URL, or "
     "an http(s):// URL"),
    ([image("data:image/svg+xml,<svg/>")], "user", RowErrorCode.INVALID_IMAGE,
     "body.messages[0].content[0].image_url.url: a data: URL must carry base64 bytes "
     "(data:<type>;base64,...)"),
])
def test_a_malformed_image_part_is_that_lines_error_naming_the_field(local_store, content, role, code,
                                                                     message) -> None:
    good, bad = read_batch(local_store, [chat_line("ok", [image(DATA_URL)]), chat_line("bad", content, role)])
    assert isinstance(good, Row)
    assert isinstance(bad, RowError) and (bad.code, bad.message) == (code, message)


def test_too_many_or_too_big_images_are_that_lines_invalid_image(local_store) -> None:
    limits = ImageLimits(max_bytes=len(PNG), max_images_per_row=2)
    big = "data:image/png;base64," + base64.b64encode(PNG + b"!").decode()
    ok, many, large = read_batch(local_store, [chat_line("ok", [image(DATA_URL)] * 2),
                                               chat_line("many", [image(DATA_URL)] * 3),
                                               chat_line("large", [image(big)])], limits)
    assert isinstance(ok, Row)
    assert (many.code, many.message) == (
        RowErrorCode.INVALID_IMAGE, "the row gives 3 images, over the limit of 2 per row (image_max_per_row)")
    assert large.code == RowErrorCode.INVALID_IMAGE
    assert large.message.startswith("body.messages[0].content[0].image_url.url: data:image/png;base64,... (")
    assert large.message.endswith(f"holds {len(PNG) + 1:,} bytes, over the limit of {len(PNG):,} an image "
                                  "may have")


def test_a_messages_column_carries_image_parts_as_an_openai_line_does(local_store) -> None:
    spec = JobSpec(input_uri="/in/rows.jsonl", input_format="jsonl", model="tiny", messages_column="m",
                   instructions="Be brief.")
    question = {"type": "text", "text": "What is it?"}
    messages = [{"role": "user", "content": [question, image("/data/cat.png")]}]
    rows = [RowBuilder(spec).build(0, {"m": messages}),
            RowBuilder(spec).build(1, {"m": json.dumps(messages)}),  # JSON text, as Parquet users store it
            RowBuilder(spec).build(2, {"m": [{"role": "user", "content": [image({"url": 3})]}]})]
    for row in rows[:2]:
        assert row.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [
            question, {"type": "image_url", "image_url": {"url": "/data/cat.png"}}]}]
    assert (rows[2].code, rows[2].message) == (
        RowErrorCode.INVALID_ROW, "messages_column 'm'[0].content[0].image_url.url must be a string")


# ------------------------------------------------------------------------------- Anthropic requests


def test_anthropic_image_blocks_become_image_url_parts_in_the_turns_order(local_store) -> None:
    text = {"type": "text", "text": "What differs?"}
    base64_block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                "data": base64.b64encode(PNG).decode()}}
    url_block = {"type": "image", "source": {"type": "url", "url": "https://img.example.com/b.jpg"},
                 "cache_control": {"type": "ephemeral"}}
    [row] = read_batch(local_store, [messages_line("a", base64_block, text, url_block)])
    assert isinstance(row, Row) and row.messages == [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": DATA_URL}}, text,
        {"type": "image_url", "image_url": {"url": "https://img.example.com/b.jpg"}}]}]
    [plain] = read_batch(local_store, [messages_line("t", text, {"type": "text", "text": "Tell me."})])
    assert plain.messages == [{"role": "user", "content": "What differs?\nTell me."}]  # text only: joined


@pytest.mark.parametrize(("source", "code", "message"), [
    ({"type": "file", "file_id": "file_01"}, RowErrorCode.INVALID_ROW,
     "params.messages[0].content[0].source.type 'file' is not supported here: give the image as base64 "
     "data or a url"),
    ({"type": "base64", "media_type": "application/pdf", "data": "JVBERi0="}, RowErrorCode.INVALID_ROW,
     "params.messages[0].content[0].source.media_type must be an image type such as image/png"),
    ({"type": "base64", "media_type": "image/png"}, RowErrorCode.INVALID_ROW,
     "params.messages[0].content[0].source.data must be base64 text"),
    ({"type": "url", "url": "gopher://x/y"}, RowErrorCode.INVALID_IMAGE,
     "params.messages[0].content[0].source.url: gopher://x/y is not an image location this server reads; "
     "give a data: URL (data:<type>;base64,...), s3://bucket/key, an absolute path or file:// URL, or an "
     "http(s):// URL"),
])
def test_an_anthropic_image_we_cannot_serve_is_that_requests_error(local_store, source, code,
                                                                   message) -> None:
    [error] = read_batch(local_store, [messages_line("a", {"type": "image", "source": source})])
    assert isinstance(error, RowError) and (error.code, error.message) == (code, message)


def test_an_image_in_an_anthropic_assistant_turn_is_refused(local_store) -> None:
    line = messages_line("a", {"type": "text", "text": "hi"})
    line["body"]["messages"] = [{"role": "user", "content": "Draw a cat."},
                                {"role": "assistant", "content": [{"type": "image", "source": {
                                    "type": "url", "url": "https://x.example/cat.png"}}]},
                                {"role": "user", "content": "Thanks."}]
    [error] = read_batch(local_store, [line])
    assert error.code == RowErrorCode.INVALID_ROW and error.message == (
        "params.messages[1].content[0] is a block of type 'image': only text and tool_use blocks are "
        "supported in an assistant turn")


# ------------------------------------------------------------------------------- image_column


def parquet_shard(store, tmp_path, table: pa.Table, spec: JobSpec, limits: ImageLimits | None = None
                  ) -> list[Row | RowError]:
    pq.write_table(table, tmp_path / "rows.parquet")
    store.put_bytes("rows.parquet", (tmp_path / "rows.parquet").read_bytes())
    [shard] = plan_shards(store, "rows.parquet", spec)
    return list(read_shard_rows(store, "rows.parquet", spec, shard, limits=limits or ImageLimits()))


def test_a_parquet_binary_image_column_gives_each_row_its_images_before_its_text(local_store,
                                                                                 tmp_path) -> None:
    spec = PLAIN.model_copy(update={"input_format": "parquet", "instructions": "Describe."})
    table = pa.table({"q": ["What is it?", "And this?", "No image."],
                      "img": pa.array([PNG, b"GIF89a", None], type=pa.binary())})
    first, second, text_only = parquet_shard(local_store, tmp_path, table, spec)
    octets = "data:application/octet-stream;base64,"
    assert first.as_chat == [{"role": "system", "content": "Describe."}, {"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": octets + base64.b64encode(PNG).decode()}},
        {"type": "text", "text": "What is it?"}]}]
    assert first.chat_required and first.prompt == "Describe.\n\nWhat is it?" and first.messages is None
    gif = octets + base64.b64encode(b"GIF89a").decode()
    assert second.as_chat[1]["content"][0]["image_url"]["url"] == gif
    assert text_only.as_chat == [{"role": "system", "content": "Describe."},
                                 {"role": "user", "content": "No image."}]
    assert not text_only.chat_required  # a text-only row renders as the job says, as before


def test_a_hugging_face_datasets_image_column_reads_its_bytes_else_its_path(local_store, tmp_path) -> None:
    """`datasets.Image` stores pictures as struct<bytes, path>; `Sequence(Image())` as a list of those;
    a missing picture is a null struct or one of two nulls."""
    spec = PLAIN.model_copy(update={"input_format": "parquet"})
    image_struct = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    cells = [{"bytes": PNG, "path": "photo.png"}, {"bytes": None, "path": "s3://pics/b.jpg"},
             {"bytes": None, "path": None}, None, {"bytes": None, "path": "photo.png"}]
    table = pa.table({"q": ["a", "b", "c", "d", "e"], "img": pa.array(cells, type=image_struct)})
    embedded, located, empty, null, relative = parquet_shard(local_store, tmp_path, table, spec)
    octets = "data:application/octet-stream;base64,"
    assert embedded.as_chat[0]["content"][0]["image_url"]["url"] == octets + base64.b64encode(PNG).decode()
    assert located.as_chat[0]["content"][0]["image_url"]["url"] == "s3://pics/b.jpg"
    for row in (empty, null):
        assert row.as_chat == [{"role": "user", "content": row.prompt}] and not row.chat_required
    assert isinstance(relative, RowError) and relative.code == RowErrorCode.INVALID_IMAGE
    assert "photo.png is not an image location this server reads" in relative.message
    listed = pa.table({"q": ["two"], "img": pa.array([[cells[0], cells[2], cells[1]]],
                                                     type=pa.list_(image_struct))})
    [row] = parquet_shard(local_store, tmp_path, listed, spec)
    assert [part["image_url"]["url"][:10] for part in row.as_chat[0]["content"][:-1]] == [
        octets[:10], "s3://pics/"]


def test_image_column_cells_may_be_locations_lists_or_empty(local_store) -> None:
    builder = RowBuilder(PLAIN, limits=ImageLimits(max_images_per_row=3))
    urls = ["/data/a.png", "s3://pics/b.jpg", DATA_URL]
    path, several, null, empty, missing = [builder.build(n, record) for n, record in enumerate([
        {"q": "one", "img": "/data/a.png"}, {"q": "three", "img": urls}, {"q": "none", "img": None},
        {"q": "none", "img": ""}, {"q": "none"}])]
    assert path.as_chat == [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "/data/a.png"}}, {"type": "text", "text": "one"}]}]
    assert [part["image_url"]["url"] for part in several.as_chat[0]["content"][:-1]] == urls
    assert several.chat_required
    for row in (null, empty, missing):
        assert isinstance(row, Row) and row.as_chat == [{"role": "user", "content": "none"}]
        assert not row.chat_required


@pytest.mark.parametrize(("cell", "message"), [
    (42, "image_column 'img' holds a value of type int: an image is bytes, a location or data: URL, a "
         "{bytes, path} image struct, or a list of those"),
    ({"url": "/a.png"}, "image_column 'img' holds a value of type dict: an image is bytes, a location or "
                        "data: URL, a {bytes, path} image struct, or a list of those"),
    (["/data/a.png", None], "image_column 'img'[1] holds a value of type NoneType: an image is bytes, a "
                            "location or data: URL, a {bytes, path} image struct, or a list of those"),
    ("cat.png", "image_column 'img': cat.png is not an image location this server reads; give a data: "
                "URL (data:<type>;base64,...), s3://bucket/key, an absolute path or file:// URL, or an "
                "http(s):// URL"),
    (["/a.png", "/b.png", "/c.png"], "image_column 'img' holds 3 images, over the limit of 2 per row "
                                     "(image_max_per_row)"),
    (b"x" * 11, "image_column 'img' holds 11 bytes, over the limit of 10 an image may have"),
])
def test_an_image_cell_that_is_no_image_is_that_rows_invalid_image(cell, message) -> None:
    error = RowBuilder(PLAIN, limits=ImageLimits(max_bytes=10, max_images_per_row=2)).build(
        3, {"q": "x", "img": cell})
    assert isinstance(error, RowError)
    assert (error.code, error.message) == (RowErrorCode.INVALID_IMAGE, message)


def test_a_jsonl_image_column_is_read_within_the_deployments_limits_by_default(local_store,
                                                                                monkeypatch) -> None:
    data = b"".join(json.dumps(record).encode() + b"\n" for record in [
        {"q": "a", "img": ["/x/1.png"]}, {"q": "b", "img": ["/x/1.png", "/x/2.png"]}])
    local_store.put_bytes("rows.jsonl", data)
    [shard] = plan_shards(local_store, "rows.jsonl", PLAIN)
    monkeypatch.setattr(settings_module, "_process_settings", Settings(image_max_per_row=1))
    one, two = read_shard_rows(local_store, "rows.jsonl", PLAIN, shard)
    assert isinstance(one, Row) and one.chat_required
    assert two.code == RowErrorCode.INVALID_IMAGE and "over the limit of 1 per row" in two.message


# ------------------------------------------------------------------------------- the spec


def test_image_column_goes_with_prompt_column_or_template_rows_that_run_as_chat() -> None:
    base = {"input_uri": "/in/rows.parquet", "model": "tiny", "image_column": "img"}
    assert JobSpec.model_validate({**base, "template": "Q: {q}"}).input_columns() == ["img", "q"]
    assert "img" in PLAIN.input_columns()
    refused = [
        ({"messages_column": "m"}, "image_column: only prompt_column or template rows take their images"),
        ({"input_format": "openai_batch"}, "image_column: only prompt_column or template rows"),
        ({"prompt_column": "q", "apply_chat_template": False},
         "image_column: rows with images run as chat; apply_chat_template false runs raw prompts"),
        ({"prompt_column": "img"}, "image_column: it is the prompt_column"),
        ({"prompt_column": "q", "task": "embed"}, "image_column: an embed job embeds text; omit it"),
    ]
    for fields, message in refused:
        with pytest.raises(ValidationError, match=message):
            JobSpec.model_validate({**base, **fields})

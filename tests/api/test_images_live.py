"""Images on a live deployment (Redis, moto S3, a real worker, the API over HTTP) with the official
`openai` and `anthropic` SDKs and our own, on a random Idefics3 checkpoint: `image_url` parts as
`data:` URLs and `s3://` locations, Anthropic base64 image blocks, a Parquet `image_column` of bytes
and locations; a missing or unreadable image, or a host not allowed, is that row's `invalid_image`
error; image tokens count in usage and in a dry run's estimate."""

from __future__ import annotations

import base64
import io
import json
import time
from collections.abc import Iterator

import anthropic
import openai
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bulkinfer.engine.vision_checkpoints import cached_vision_checkpoint
from tests.api.live_stack import ENGINE_OPTIONS, LiveStack, live_stack
from tests.fixtures.services import RedisServer, S3Server
from tests.support.vision_reference import picture

pytestmark = pytest.mark.timeout(400)
TIMEOUT_S = 240


def png(seed: int) -> bytes:
    buffer = io.BytesIO()
    picture(seed, 40, 60).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def stack(redis_server: RedisServer, s3_server: S3Server, checkpoint_factory,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveStack]:
    vlm = str(cached_vision_checkpoint("tiny"))
    settings = {"model_aliases": {"gpt-4o-mini": "vlm", "claude-haiku-4-5": "vlm"}}
    with live_stack(redis_server, s3_server, checkpoint_factory(), tmp_path_factory.mktemp("model-cache"),
                    models={"vlm": vlm}, worker_served=("vlm",), settings_fields=settings,
                    engine_options={**ENGINE_OPTIONS, "max_model_len": 1024}) as live:
        live.put_input("photos/a.png", png(0))
        yield live


def line(custom_id: str, url: str) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "gpt-4o-mini", "max_tokens": 6, "temperature": 0, "messages": [{
                "role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                            {"type": "text", "text": "Caption this."}]}]}}


def test_openai_batch_lines_with_images(stack: LiveStack) -> None:
    sdk = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)
    data_url = "data:image/png;base64," + base64.b64encode(png(1)).decode()
    lines = [line("inline", data_url), line("stored", f"s3://{stack.inputs_bucket}/photos/a.png"),
             line("missing", f"s3://{stack.inputs_bucket}/photos/none.png"),
             line("corrupt", "data:image/png;base64," + base64.b64encode(b"no picture").decode()),
             line("web", "https://example.com/cat.png")]
    data = b"".join(json.dumps(item).encode() + b"\n" for item in lines)
    uploaded = sdk.files.create(file=("photos.jsonl", data), purpose="batch")
    batch = sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                               completion_window="24h")
    deadline = time.monotonic() + TIMEOUT_S
    while (batch := sdk.batches.retrieve(batch.id)).status not in ("completed", "failed", "expired"):
        assert time.monotonic() < deadline, batch.status
        time.sleep(0.3)
    assert batch.status == "completed", batch.errors
    outputs = {json.loads(text)["custom_id"]: json.loads(text)
               for text in sdk.files.content(batch.output_file_id).read().splitlines()}
    for custom_id in ("inline", "stored"):
        body = outputs[custom_id]["response"]["body"]
        assert outputs[custom_id]["response"]["status_code"] == 200, outputs[custom_id]
        assert body["choices"][0]["message"]["content"] and body["usage"]["prompt_tokens"] > 20
    errors = {json.loads(text)["custom_id"]: json.loads(text)
              for text in sdk.files.content(batch.error_file_id).read().splitlines()}
    for custom_id, words in (("missing", "not found"), ("corrupt", "not an image"), ("web", "not allowed")):
        error = errors[custom_id]["error"] or errors[custom_id]["response"]["body"]["error"]
        assert error["code"] == "invalid_image" and words in error["message"], errors[custom_id]


def test_anthropic_image_blocks(stack: LiveStack) -> None:
    sdk = anthropic.Anthropic(base_url=stack.url, api_key="unused", max_retries=0)
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(png(2)).decode()}}
    batch = sdk.messages.batches.create(requests=[{"custom_id": "photo", "params": {
        "model": "claude-haiku-4-5", "max_tokens": 6, "temperature": 0,
        "messages": [{"role": "user", "content": [block, {"type": "text", "text": "Caption this."}]}]}}])
    deadline = time.monotonic() + TIMEOUT_S
    while sdk.messages.batches.retrieve(batch.id).processing_status != "ended":
        assert time.monotonic() < deadline
        time.sleep(0.3)
    [item] = list(sdk.messages.batches.results(batch.id))
    assert item.result.type == "succeeded", item.result
    assert item.result.message.content[0].text and item.result.message.usage.input_tokens > 20


def test_a_parquet_image_column_job_and_its_dry_run(stack: LiveStack) -> None:
    # A binary column (a column of locations: the OpenAI test's s3:// line, and tests/jobs).
    photos = pa.array([png(3), png(4), None], pa.binary())
    table = pa.table({"id": ["bytes", "other", "none"], "photo": photos})
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    uri = stack.put_input("photos.parquet", buffer.getvalue())
    spec = {"model": "vlm", "input_uri": uri, "input_format": "parquet", "id_column": "id",
            "template": "Write a caption.", "image_column": "photo",
            "sampling": {"temperature": 0, "max_tokens": 6}}
    estimate = stack.client.jobs.estimate(spec)
    text_only = stack.client.jobs.estimate({**spec, "image_column": None, "template": "Write a caption.{id}"})
    assert estimate.rows == 3 and estimate.prompt_tokens > text_only.prompt_tokens + 2 * 20
    assert estimate.rows_deduplicated == 0  # the same question over other pictures is no copy
    done = stack.client.jobs.wait(stack.client.jobs.create(spec), poll_interval=0.2, timeout=TIMEOUT_S)
    assert done.state == "succeeded", done.error
    rows = {row["id"]: row for row in stack.client.jobs.results(done)}
    for key in ("bytes", "other", "none"):
        assert rows[key]["error"] is None and rows[key]["text"], rows[key]

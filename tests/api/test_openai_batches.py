"""OpenAI batch code, unchanged but for `base_url` and the key: the official `openai` package as the
client, over real HTTP, against a live deployment (Redis, moto S3, a real worker serving `tiny`).

Upload → create → poll → download → parse with the SDK's own types; cancel mid-run; list pagination;
expiry; tenant isolation; malformed input files; an API restart mid-batch.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from openai.types import Batch
from openai.types.chat import ChatCompletion
from openai.types.completion import Completion

from bulkinfer.api.app import create_app
from bulkinfer.api.cli.server import ServerThread
from tests.api.live_stack import LiveStack, live_stack
from tests.fixtures.services import RedisServer, S3Server, free_port

pytestmark = pytest.mark.timeout(300)

KEYS = "acme=acme-key,globex=globex-key"
ADMIN = "root-key"
ALIASES = {"gpt-4o-mini": "tiny", "gpt-4.1": "small"}  # `small`: served, but no worker runs it
BATCH_TIMEOUT_S = 120
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def stack(redis_server: RedisServer, s3_server: S3Server, tiny_checkpoint: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveStack]:
    settings = {"api_keys": KEYS, "admin_api_keys": ADMIN, "model_aliases": ALIASES, "reaper_interval_s": 0.5}
    with live_stack(redis_server, s3_server, tiny_checkpoint, tmp_path_factory.mktemp("model-cache"),
                    settings_fields=settings) as live:
        yield live


def client(stack: LiveStack, key: str = "acme-key", url: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url or stack.url}/v1", api_key=key, max_retries=0)


def chat_line(custom_id: str, text: str, model: str = "gpt-4o-mini", **body: object) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": CHAT,
            "body": {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 4,
                     "temperature": 0, **body}}


def jsonl(lines: list[dict]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def upload(sdk: openai.OpenAI, lines: list[dict], name: str = "requests.jsonl") -> str:
    return sdk.files.create(file=(name, jsonl(lines)), purpose="batch").id


def wait(sdk: openai.OpenAI, batch_id: str, until: frozenset[str] = frozenset(
        {"completed", "failed", "expired", "cancelled"}), timeout: float = BATCH_TIMEOUT_S) -> Batch:
    deadline = time.monotonic() + timeout
    while True:
        batch = sdk.batches.retrieve(batch_id)
        if batch.status in until:
            return batch
        assert time.monotonic() < deadline, f"batch {batch_id} still {batch.status} after {timeout}s"
        time.sleep(0.2)


def file_lines(sdk: openai.OpenAI, file_id: str) -> list[dict]:
    return [json.loads(line) for line in sdk.files.content(file_id).read().splitlines()]


def test_a_batch_runs_end_to_end_and_the_sdk_parses_every_piece(stack: LiveStack) -> None:
    sdk = client(stack)
    lines = [chat_line(f"q{n}", f"Question {n}?") for n in range(4)]
    lines.append(chat_line("bad", "Too hot?", temperature=-1))  # that request's error, not the batch's
    file_id = upload(sdk, lines)
    batch = sdk.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h",
                               metadata={"run": "nightly"})
    assert batch.status in ("validating", "in_progress") and batch.model == "tiny"
    assert batch.metadata == {"run": "nightly"} and batch.input_file_id == file_id
    assert batch.request_counts is not None and batch.request_counts.total == 5

    done = wait(sdk, batch.id)
    assert done.status == "completed" and done.completed_at and done.in_progress_at
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (5, 4, 1)
    assert done.usage is not None and done.usage.input_tokens > 0 and done.usage.output_tokens > 0
    assert done.usage.total_tokens == done.usage.input_tokens + done.usage.output_tokens

    outputs = file_lines(sdk, str(done.output_file_id))
    assert [line["custom_id"] for line in outputs] == ["q0", "q1", "q2", "q3"]
    for line in outputs:
        assert line["error"] is None and line["response"]["status_code"] == 200
        completion = ChatCompletion.model_validate(line["response"]["body"])
        assert completion.choices[0].message.role == "assistant" and completion.usage is not None
    errors = file_lines(sdk, str(done.error_file_id))
    assert [line["custom_id"] for line in errors] == ["bad"]
    assert errors[0]["response"] is None and "temperature" in errors[0]["error"]["message"]

    output_file = sdk.files.retrieve(str(done.output_file_id))
    assert output_file.purpose == "batch_output"
    assert output_file.bytes == len(sdk.files.content(output_file.id).read())
    assert {output_file.id, done.error_file_id} <= {f.id for f in sdk.files.list()}
    # The same batch is a job underneath, the caller's tenant's, at /jobs too.
    job = httpx.get(f"{stack.url}/jobs/job-{batch.id.removeprefix('batch_')}",
                    headers={"Authorization": "Bearer acme-key"}).json()
    assert job["state"] == "succeeded" and job["tenant"] == "acme" and job["rows"]["succeeded"] == 4
    assert sdk.batches.retrieve(batch.id).output_file_id == done.output_file_id  # published once


def test_a_completions_batch_runs_and_parses(stack: LiveStack) -> None:
    sdk = client(stack)
    lines = [{"custom_id": f"c{n}", "method": "POST", "url": "/v1/completions",
              "body": {"model": "gpt-4o-mini", "prompt": f"def f{n}(", "max_tokens": 3, "temperature": 0}}
             for n in range(2)]
    batch = sdk.batches.create(input_file_id=upload(sdk, lines), endpoint="/v1/completions",
                               completion_window="24h")
    done = wait(sdk, batch.id)
    assert done.status == "completed"
    for line in file_lines(sdk, str(done.output_file_id)):
        assert Completion.model_validate(line["response"]["body"]).choices[0].text is not None


def test_cancelling_a_running_batch(stack: LiveStack) -> None:
    sdk = client(stack)
    file_id = upload(sdk, [chat_line(f"s{n}", "Hi", model="gpt-4.1") for n in range(3)])
    batch = sdk.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")
    wait(sdk, batch.id, until=frozenset({"in_progress"}), timeout=30)
    cancelling = sdk.batches.cancel(batch.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at is not None
    cancelled = sdk.batches.retrieve(batch.id)
    assert cancelled.status == "cancelled" and cancelled.cancelled_at is not None
    assert cancelled.request_counts is not None and cancelled.request_counts.completed == 0
    assert cancelled.output_file_id is None  # nothing ran
    with pytest.raises(openai.ConflictError, match="nothing to cancel"):
        sdk.batches.cancel(wait(sdk, upload_and_run(sdk)).id)


def test_cancelling_a_cancelled_batch_is_a_conflict_like_any_ended_batch(stack: LiveStack) -> None:
    sdk = client(stack)
    file_id = upload(sdk, [chat_line("c", "Hi", model="gpt-4.1")])
    batch = sdk.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")
    assert sdk.batches.cancel(batch.id).status == "cancelling"
    with pytest.raises(openai.ConflictError, match="already cancelled; there is nothing to cancel"):
        sdk.batches.cancel(batch.id)
    assert sdk.batches.retrieve(batch.id).status == "cancelled"
    # Our own route stays idempotent (the bulkinfer SDK retries a cancel whose answer was lost).
    job_id = f"job-{batch.id.removeprefix('batch_')}"
    again = httpx.post(f"{stack.url}/jobs/{job_id}/cancel", headers={"Authorization": "Bearer acme-key"})
    assert again.status_code == 200 and again.json()["state"] == "cancelled"


def test_a_deleted_output_file_stays_deleted_and_the_batch_keeps_its_id(stack: LiveStack) -> None:
    sdk = client(stack)
    lines = [chat_line("ok", "Hi"), chat_line("bad", "Too hot?", temperature=-1)]
    batch = sdk.batches.create(input_file_id=upload(sdk, lines), endpoint=CHAT, completion_window="24h")
    done = wait(sdk, batch.id)
    assert done.output_file_id is not None and done.error_file_id is not None
    for file_id in (done.output_file_id, done.error_file_id):
        assert sdk.files.delete(file_id).deleted
    for _ in range(2):  # reading the batch again publishes nothing again
        again = sdk.batches.retrieve(batch.id)
        assert (again.output_file_id, again.error_file_id) == (done.output_file_id, done.error_file_id)
        for file_id in (done.output_file_id, done.error_file_id):
            with pytest.raises(openai.NotFoundError):
                sdk.files.retrieve(file_id)
            with pytest.raises(openai.NotFoundError):
                sdk.files.content(file_id)
    assert {done.output_file_id, done.error_file_id}.isdisjoint(f.id for f in sdk.files.list())


def upload_and_run(sdk: openai.OpenAI) -> str:
    return sdk.batches.create(input_file_id=upload(sdk, [chat_line("one", "Hi")]), endpoint=CHAT,
                              completion_window="24h").id


def test_listing_pages_through_every_batch_newest_first(stack: LiveStack) -> None:
    sdk = client(stack, "globex-key")
    file_id = upload(sdk, [chat_line("x", "Hi", model="gpt-4.1")])
    created = [sdk.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h").id
               for _ in range(5)]
    first = sdk.batches.list(limit=2)
    assert [batch.id for batch in first.data] == created[::-1][:2] and first.has_more
    second = sdk.batches.list(limit=2, after=first.data[-1].id).data
    assert [batch.id for batch in second] == created[::-1][2:4]
    assert [batch.id for batch in sdk.batches.list(limit=2)] == created[::-1]  # the SDK's auto-paging
    for batch_id in created:
        sdk.batches.cancel(batch_id)


def test_a_batch_past_its_window_expires_with_its_rows_in_the_error_file(stack: LiveStack) -> None:
    sdk = client(stack)
    file_id = upload(sdk, [chat_line(f"e{n}", "Hi", model="gpt-4.1") for n in range(2)])
    batch = sdk.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="2s")
    assert batch.expires_at is not None and batch.expires_at - batch.created_at in (2, 3)
    expired = wait(sdk, batch.id, timeout=60)
    assert expired.status == "expired" and expired.expired_at is not None
    errors = file_lines(sdk, str(expired.error_file_id))
    assert sorted(line["custom_id"] for line in errors) == ["e0", "e1"]
    assert {line["error"]["code"] for line in errors} == {"batch_expired"}


def test_a_tenant_never_sees_another_tenants_files_or_batches(stack: LiveStack) -> None:
    acme, globex, admin = client(stack), client(stack, "globex-key"), client(stack, ADMIN)
    file_id = upload(acme, [chat_line("p", "Hi", model="gpt-4.1")])
    batch = acme.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        globex.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        globex.batches.cancel(batch.id)
    with pytest.raises(openai.NotFoundError):  # acme's file cannot be globex's batch input
        globex.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")
    assert batch.id not in {b.id for b in globex.batches.list()}
    assert batch.id in {b.id for b in admin.batches.list()}
    assert admin.batches.retrieve(batch.id).id == batch.id
    with pytest.raises(openai.AuthenticationError):
        client(stack, "wrong-key").batches.list()
    acme.batches.cancel(batch.id)


def test_a_malformed_input_file_fails_the_batch_saying_which_lines(stack: LiveStack) -> None:
    sdk = client(stack)
    good = chat_line("a", "Hi")
    other_url = {**chat_line("b", "Hi"), "url": "/v1/completions"}
    data = jsonl([good]) + b"{not json\n" + jsonl([good, other_url])
    file_id = sdk.files.create(file=("bad.jsonl", data), purpose="batch").id
    batch = sdk.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")
    assert batch.status == "failed" and batch.failed_at is not None and batch.errors is not None
    problems = {(error.code, error.line) for error in batch.errors.data or []}
    assert ("invalid_json_line", 2) in problems and ("duplicate_custom_id", 3) in problems
    assert ("mismatched_endpoint", 4) in problems
    assert sdk.batches.retrieve(batch.id).status == "failed"
    unknown = upload(sdk, [chat_line("m", "Hi", model="gpt-9")])
    refused = sdk.batches.create(input_file_id=unknown, endpoint=CHAT, completion_window="24h")
    assert refused.status == "failed" and refused.errors is not None and refused.errors.data
    assert refused.errors.data[0].code == "model_not_found" and "gpt-9" in str(refused.errors.data[0].message)
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        sdk.batches.create(input_file_id=file_id, endpoint="/v1/images/generations", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        sdk.batches.create(input_file_id="file-000000000000000000000000", endpoint=CHAT,
                           completion_window="24h")


def test_what_a_batch_keeps_of_its_file_and_metadata_is_bounded(stack: LiveStack) -> None:
    """48 lines with 1 MiB urls once made a 50 MB batch that every listing returned."""
    sdk = client(stack)
    lines = [{**chat_line(f"u{i}", "Hi"), "url": f"/v1/{'x' * (1 << 20)}{i}"} for i in range(48)]
    file_id = upload(sdk, lines, "huge-urls.jsonl")
    batch = sdk.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")
    assert batch.status == "failed" and batch.errors is not None and len(batch.errors.data or []) == 48
    listed = httpx.get(f"{stack.url}/v1/batches", headers={"Authorization": "Bearer acme-key"})
    assert listed.status_code == 200 and len(listed.content) < 200_000
    with pytest.raises(openai.BadRequestError, match="metadata"):
        sdk.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h",
                           metadata={"note": "x" * 1_000_000})


def test_models_lists_the_served_models_and_aliases(stack: LiveStack) -> None:
    names = {model.id for model in client(stack).models.list()}
    assert {"tiny", "gpt-4o-mini"} <= names


def test_a_batch_survives_an_api_restart(stack: LiveStack) -> None:
    assert stack.settings is not None
    port = free_port()
    with ServerThread(create_app(stack.settings), port=port) as first:
        sdk = client(stack, url=first.url)
        lines = [chat_line(f"r{n}", f"Restart {n}?", max_tokens=64, ignore_eos=True) for n in range(6)]
        batch = sdk.batches.create(input_file_id=upload(sdk, lines), endpoint=CHAT, completion_window="24h")
    job_id = f"job-{batch.id.removeprefix('batch_')}"
    assert not stack.repository.get(job_id).state.is_terminal  # the API went away mid-batch
    with ServerThread(create_app(stack.settings), port=port) as second:  # a new process's state: nothing kept
        sdk = client(stack, url=second.url)
        done = wait(sdk, batch.id)
        assert done.status == "completed" and done.request_counts is not None
        assert done.request_counts.completed == 6
        assert sorted(line["custom_id"] for line in file_lines(sdk, str(done.output_file_id))) == \
            [f"r{n}" for n in range(6)]

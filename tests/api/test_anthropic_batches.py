"""Anthropic Message Batches code, unchanged but for `base_url` and the key: the official
`anthropic` package as the client, over real HTTP, against a live deployment (Redis, moto S3, a real
worker serving `tiny`): create → poll → results parsed with the SDK's own types; a request we
cannot serve is that request's `errored` result; cancel; list pagination; delete; tenants; restart.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import pytest
from anthropic.types.messages import MessageBatch

from bulkinfer.api.app import create_app
from bulkinfer.api.cli.server import ServerThread
from tests.api.live_stack import LiveStack, live_stack
from tests.fixtures.services import RedisServer, S3Server, free_port

pytestmark = pytest.mark.timeout(300)

KEYS = "acme=acme-key,globex=globex-key"
ALIASES = {"claude-haiku-4-5": "tiny", "claude-opus-4-1": "small"}  # `small`: served, no worker runs it
BATCH_TIMEOUT_S = 120
SLOW = "claude-opus-4-1"  # its batches run on `small` and stay in progress until cancelled


@pytest.fixture(scope="module")
def stack(redis_server: RedisServer, s3_server: S3Server, tiny_checkpoint: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveStack]:
    with live_stack(redis_server, s3_server, tiny_checkpoint, tmp_path_factory.mktemp("model-cache"),
                    settings_fields={"api_keys": KEYS, "model_aliases": ALIASES}) as live:
        yield live


def client(stack: LiveStack, key: str = "acme-key", url: str | None = None) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url or stack.url, api_key=key, max_retries=0)


def request(custom_id: str, content: object = "Hello?", model: str = "claude-haiku-4-5",
            **params: object) -> dict:
    return {"custom_id": custom_id,
            "params": {"model": model, "max_tokens": 4, "temperature": 0,
                       "messages": [{"role": "user", "content": content}], **params}}


def wait(sdk: anthropic.Anthropic, batch_id: str, timeout: float = BATCH_TIMEOUT_S) -> MessageBatch:
    deadline = time.monotonic() + timeout
    while True:
        batch = sdk.messages.batches.retrieve(batch_id)
        if batch.processing_status == "ended":
            return batch
        assert time.monotonic() < deadline, f"batch {batch_id} still {batch.processing_status}"
        time.sleep(0.2)


def test_a_message_batch_runs_and_the_sdk_parses_its_results(stack: LiveStack) -> None:
    sdk = client(stack)
    batch = sdk.messages.batches.create(requests=[
        request("plain"),
        request("blocks", [{"type": "text", "text": "Say"}, {"type": "text", "text": "hi"}],
                system="Be brief."),
        request("tools", tools=[{"name": "lookup", "description": "d", "input_schema": {"type": "object"}}]),
    ])
    assert batch.processing_status == "in_progress" and batch.request_counts.processing == 3
    ended = wait(sdk, batch.id)
    assert ended.ended_at is not None and ended.results_url is not None
    assert (ended.request_counts.succeeded, ended.request_counts.errored) == (2, 1)
    results = {item.custom_id: item.result for item in sdk.messages.batches.results(batch.id)}
    assert set(results) == {"plain", "blocks", "tools"}
    for custom_id in ("plain", "blocks"):
        result = results[custom_id]
        assert result.type == "succeeded"
        message = result.message
        assert message.role == "assistant" and message.content[0].type == "text"
        assert message.stop_reason in ("end_turn", "max_tokens", "stop_sequence")
        assert message.usage.input_tokens > 0 and message.usage.output_tokens > 0
    refused = results["tools"]
    assert refused.type == "errored" and "tools" in refused.error.error.message


def test_cancel_then_delete(stack: LiveStack) -> None:
    sdk = client(stack)
    batch = sdk.messages.batches.create(requests=[request(f"s{n}", model=SLOW) for n in range(3)])
    with pytest.raises(anthropic.ConflictError, match="cancel it"):
        sdk.messages.batches.delete(batch.id)
    canceling = sdk.messages.batches.cancel(batch.id)
    assert canceling.processing_status == "canceling" and canceling.cancel_initiated_at is not None
    ended = wait(sdk, batch.id)
    assert ended.request_counts.canceled == 3
    assert {item.result.type for item in sdk.messages.batches.results(batch.id)} == {"canceled"}
    assert sdk.messages.batches.delete(batch.id).type == "message_batch_deleted"
    with pytest.raises(anthropic.NotFoundError):
        sdk.messages.batches.retrieve(batch.id)


def test_cancelling_a_cancelled_batch_is_a_conflict_like_any_ended_batch(stack: LiveStack) -> None:
    sdk = client(stack)
    batch = sdk.messages.batches.create(requests=[request("c", model=SLOW)])
    assert sdk.messages.batches.cancel(batch.id).processing_status == "canceling"
    with pytest.raises(anthropic.ConflictError, match="already canceled; there is nothing to cancel"):
        sdk.messages.batches.cancel(batch.id)
    ended = sdk.messages.batches.retrieve(batch.id)
    assert ended.processing_status == "ended" and ended.request_counts.canceled == 1


def test_listing_pages_both_ways(stack: LiveStack) -> None:
    sdk = client(stack, "globex-key")
    created = [sdk.messages.batches.create(requests=[request("x", model=SLOW)]).id for _ in range(4)]
    newest_first = created[::-1]
    page = sdk.messages.batches.list(limit=2)
    assert [batch.id for batch in page.data] == newest_first[:2] and page.has_more
    older = sdk.messages.batches.list(limit=2, after_id=newest_first[1]).data
    assert [batch.id for batch in older] == newest_first[2:]
    newer = sdk.messages.batches.list(limit=2, before_id=newest_first[2]).data
    assert [batch.id for batch in newer] == newest_first[:2]
    assert [batch.id for batch in sdk.messages.batches.list(limit=3)] == newest_first  # auto-paging
    for batch_id in created:
        sdk.messages.batches.cancel(batch_id)


def test_a_tenant_never_sees_another_tenants_batches(stack: LiveStack) -> None:
    acme, globex = client(stack), client(stack, "globex-key")
    batch = acme.messages.batches.create(requests=[request("p", model=SLOW)])
    for call in (globex.messages.batches.retrieve, globex.messages.batches.cancel,
                 globex.messages.batches.delete):
        with pytest.raises(anthropic.NotFoundError):
            call(batch.id)
    assert batch.id not in {b.id for b in globex.messages.batches.list()}
    with pytest.raises(anthropic.AuthenticationError):
        client(stack, "wrong-key").messages.batches.list()
    acme.messages.batches.cancel(batch.id)


def test_bad_requests_are_refused_with_anthropics_errors(stack: LiveStack) -> None:
    sdk = client(stack)
    with pytest.raises(anthropic.BadRequestError, match="custom_id"):
        sdk.messages.batches.create(requests=[request("same"), request("same")])
    with pytest.raises(anthropic.BadRequestError, match="not served"):
        sdk.messages.batches.create(requests=[request("m", model="claude-unknown")])


def test_a_request_for_a_model_the_batch_does_not_run_is_told_about_the_model(stack: LiveStack) -> None:
    sdk = client(stack)
    batch = sdk.messages.batches.create(requests=[
        request("aliased"), request("unaliased", model="claude-sonnet-4-5"), request("other", model=SLOW)])
    wait(sdk, batch.id)
    results = {item.custom_id: item.result for item in sdk.messages.batches.results(batch.id)}
    assert results["aliased"].type == "succeeded"
    unaliased, other = results["unaliased"], results["other"]
    assert unaliased.type == other.type == "errored"
    assert unaliased.error.error.type == "invalid_request_error"
    assert unaliased.error.error.message == (
        "model 'claude-sonnet-4-5' is not served here (served: small, tiny; aliases: "
        "claude-haiku-4-5 → tiny, claude-opus-4-1 → small); to send 'claude-sonnet-4-5' to a served model, "
        "add an alias: BULKINFER_MODEL_ALIASES='{\"claude-haiku-4-5\": \"tiny\", \"claude-opus-4-1\": "
        "\"small\", \"claude-sonnet-4-5\": \"tiny\"}' (the model_aliases setting)")
    assert other.error.error.message.startswith(
        "model 'claude-opus-4-1' (an alias of 'small') is served here, but this batch runs 'tiny'")


def test_a_message_batch_survives_an_api_restart(stack: LiveStack) -> None:
    assert stack.settings is not None
    port = free_port()
    with ServerThread(create_app(stack.settings), port=port) as first:
        batch = client(stack, url=first.url).messages.batches.create(
            requests=[request(f"r{n}", f"Restart {n}?", max_tokens=64) for n in range(4)])
    job_id = f"job-{batch.id.removeprefix('msgbatch_')}"
    assert not stack.repository.get(job_id).state.is_terminal  # the API went away mid-batch
    with ServerThread(create_app(stack.settings), port=port) as second:
        sdk = client(stack, url=second.url)
        ended = wait(sdk, batch.id)
        assert ended.request_counts.succeeded == 4
        assert sorted(item.custom_id for item in sdk.messages.batches.results(batch.id)) == \
            [f"r{n}" for n in range(4)]

"""Completion webhooks, one component at a time: signing, one delivery attempt against a real local
HTTP receiver, and "send once per job". The retried delivery through a worker is in
tests/api/test_schedules_live.py.
"""

from __future__ import annotations

import json
import socket

import pytest

from bulkinfer.jobs import webhooks
from bulkinfer.jobs.settings import Settings
from bulkinfer.jobs.spec import JobSpec
from bulkinfer.jobs.state.status import JobState
from bulkinfer.jobs.webhooks import destination_problem, redacted
from bulkinfer.worker.process.context import WorkerContext
from bulkinfer.worker.process.webhook_delivery import (
    RejectedDelivery,
    RetryableDelivery,
    deliver,
    delivery_state,
    notify_if_final,
    post,
)
from tests.fixtures.services import free_port
from tests.support.webhook_receiver import webhook_receiver

SECRET = "test-secret"


@pytest.fixture
def context(redis_url, tmp_path) -> WorkerContext:
    # The receivers here listen on 127.0.0.1 over http: both allowed only by these settings.
    settings = Settings(broker_url=redis_url, store_uri=str(tmp_path / "store"), webhook_secret=SECRET,
                        webhook_allow_http=True, webhook_allow_private=True)
    return WorkerContext(settings)


def create_job(context: WorkerContext, **changes) -> str:
    fields = {"input_uri": "/in/rows.jsonl", "input_format": "jsonl", "model": "m", "prompt_column": "q"}
    return context.repository.create(JobSpec(**{**fields, **changes})).job_id


def test_a_signature_verifies_only_the_exact_body_under_the_same_secret() -> None:
    body = b'{"event":"job.finished"}'
    header = webhooks.sign(SECRET, body)
    assert header.startswith("sha256=") and webhooks.verify_signature(SECRET, body, header)
    assert not webhooks.verify_signature(SECRET, body + b" ", header)
    assert not webhooks.verify_signature("other", body, header)
    assert not webhooks.verify_signature(SECRET, body, None)
    assert not webhooks.verify_signature(SECRET, body, header.removeprefix("sha256="))


def test_webhook_url_on_a_job_spec_must_be_http() -> None:
    with pytest.raises(ValueError, match="webhook_url\n.*must be an http:// or https:// URL"):
        JobSpec(input_uri="/in/x.jsonl", model="m", prompt_column="q", webhook_url="file:///etc/passwd")


def test_a_delivery_posts_the_final_status_signed_with_its_delivery_id(context) -> None:
    with webhook_receiver() as receiver:
        job_id = create_job(context, webhook_url=receiver.url)
        context.repository.transition(job_id, JobState.FAILED, error="input unreadable")

        assert deliver(context, job_id)["status"] == "delivered"
        assert deliver(context, job_id)["status"] == "skipped: already delivered"

    [request] = receiver.requests
    assert webhooks.verify_signature(SECRET, request.body, request.headers[webhooks.SIGNATURE_HEADER])
    body = json.loads(request.body)
    assert body["event"] == "job.finished" and body["delivery_id"] == f"{job_id}.failed"
    assert request.headers[webhooks.DELIVERY_HEADER] == f"{job_id}.failed"
    assert request.headers[webhooks.TIMESTAMP_HEADER] == str(body["timestamp"])
    assert (body["job"]["job_id"], body["job"]["state"], body["job"]["error"]) == (
        job_id, "failed", "input unreadable")
    assert delivery_state(context, job_id) == "delivered"


def test_an_answer_that_may_change_is_retryable_and_a_refusal_is_final() -> None:
    with webhook_receiver([503, 429, 400]) as receiver:
        for expected in (RetryableDelivery, RetryableDelivery, RejectedDelivery):
            with pytest.raises(expected):
                post(receiver.url, b"{}", {}, allow_private=True)
        assert post(receiver.url, b"{}", {}, allow_private=True) == 200
    with pytest.raises(RetryableDelivery, match="ConnectError"):
        post(f"http://127.0.0.1:{free_port()}/hook", b"{}", {}, allow_private=True)


@pytest.mark.parametrize(("url", "problem"), [
    ("http://hooks.example.com/x", "must be an https:// URL"),
    ("https://localhost/x", "is this machine"),
    ("https://127.0.0.1:8443/x", "loopback"),
    ("https://169.254.169.254/latest/meta-data", "link-local"),
    ("https://10.1.2.3/x", "private"),
    ("https://[::1]/x", "loopback"),
    ("https://[::ffff:127.0.0.1]/x", "loopback"),
    ("https://0.0.0.0/x", "unspecified"),
    ("https://100.100.100.200/latest/meta-data", "non-global"),  # shared space: a cloud's metadata service
    ("https://[::ffff:100.64.0.1]/x", "non-global"),
    ("https://[2002:7f00:1::]/x", "6to4 tunnel"),  # reaches 127.0.0.1 through a relay
    ("https://[2001:0:4136:e378:8000:63bf:3fff:fdd2]/x", "Teredo tunnel"),
    ("https://[64:ff9b::a9fe:a9fe]/x", "link-local"),  # NAT64 of 169.254.169.254
    ("https://198.18.0.1/x", "private"),  # benchmarking range
    ("https://[ff0e::1]/x", "multicast"),
])
def test_webhooks_to_plain_http_or_this_network_are_refused_by_default(url: str, problem: str) -> None:
    found = destination_problem(url, allow_http=False, allow_private=False)
    assert found is not None and problem in found
    public = "https://hooks.example.com/x?token=1"
    assert destination_problem(public, allow_http=False, allow_private=False) is None
    assert destination_problem(url, allow_http=True, allow_private=True) is None


def test_a_name_that_resolves_to_this_machine_is_refused_when_delivering_and_no_reply_is_kept() -> None:
    with webhook_receiver([200]) as receiver:
        port = receiver.url.split(":")[2].split("/")[0]
        with pytest.raises(RejectedDelivery, match="resolves to 127.0.0.1, a loopback address"):
            post(f"http://localhost:{port}/hook", b"{}", {})
        assert receiver.requests == []  # refused before any connection
    with webhook_receiver([400]) as receiver:
        with pytest.raises(RejectedDelivery) as refused:
            post(receiver.url, b"{}", {}, allow_private=True)
        assert str(refused.value) == "HTTP 400"  # the receiver's reply is not stored


def test_every_address_a_name_resolves_to_must_be_global(monkeypatch) -> None:
    answers = ["93.184.216.34", "100.100.100.200"]  # one public, one in the shared address space
    monkeypatch.setattr(socket, "getaddrinfo", lambda *_args, **_kw: [
        (socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, 443)) for address in answers])
    with pytest.raises(RejectedDelivery, match="100.100.100.200, a non-global"):
        post("https://hooks.example.com/x", b"{}", {})
    assert destination_problem("https://[64:ff9b::808:808]/x", allow_http=False, allow_private=False) is None


def test_urls_in_logs_lose_their_query_and_credentials() -> None:
    assert redacted("https://user:pw@hooks.example.com:8443/a/b?token=s3cret#x") == \
        "https://hooks.example.com:8443/a/b"


def test_a_job_that_ended_starts_one_delivery_however_many_tasks_see_it_end(context) -> None:
    sent: list[str] = []
    job_id = create_job(context, webhook_url="http://127.0.0.1:9/hook")
    assert not notify_if_final(context, job_id, sent.append)  # still queued
    context.repository.request_cancel(job_id)
    assert notify_if_final(context, job_id, sent.append)
    assert not notify_if_final(context, job_id, sent.append)
    assert sent == [job_id] and delivery_state(context, job_id) == "queued"


def test_a_job_without_a_webhook_url_sends_nothing(context) -> None:
    sent: list[str] = []
    job_id = create_job(context)
    context.repository.request_cancel(job_id)
    assert not notify_if_final(context, job_id, sent.append)
    assert sent == [] and delivery_state(context, job_id) is None

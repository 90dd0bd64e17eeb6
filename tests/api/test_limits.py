"""Limits over real HTTP: uploads past max_upload_bytes are 413, a tenant past max_jobs_in_flight
gets 429, and so does a key past max_requests_per_s; each message names its limit."""

from __future__ import annotations

import io
import json

import httpx
import pytest

from bulkinfer.api.client import ApiError, Client
from bulkinfer.jobs.settings import Settings
from tests.api.conftest import MODELS, serve

ROWS = b'{"q": "def f(x):"}\n'
KEYS = "acme=acme-secret,globex=globex-secret"


def limited(redis_url, tmp_path, **limits):  # noqa: ANN001, ANN003, ANN201
    settings = Settings(broker_url=redis_url, store_uri=str(tmp_path / "store"), models=json.dumps(MODELS),
                        api_keys=KEYS, **limits)
    return serve(settings)


def spec(api, name: str, owner: str = "acme", **fields) -> dict:  # noqa: ANN001, ANN003
    """Rows in `owner`'s own folder, where its key may read them."""
    return {"input_uri": api.put_tenant_input(owner, name, ROWS), "model": "tiny", "prompt_column": "q",
            **fields}


def test_an_upload_past_max_upload_bytes_is_413_and_leaves_nothing(redis_url, tmp_path) -> None:
    with limited(redis_url, tmp_path, max_upload_bytes=1000) as api, \
            Client(api.url, api_key="acme-secret") as acme:
        with pytest.raises(ApiError) as refused:
            acme.jobs.create({"model": "tiny", "prompt_column": "q"}, file=io.BytesIO(ROWS * 200),
                             filename="big.jsonl")
        assert refused.value.status_code == 413 and "max_upload_bytes (1,000 bytes)" in refused.value.message
        assert list(acme.jobs.list()) == []
        stored = [p.name for p in (tmp_path / "store").rglob("*") if p.is_file()]
        assert not any(name.endswith(".jsonl") for name in stored), stored
        small = acme.jobs.create({"model": "tiny", "prompt_column": "q"}, file=io.BytesIO(ROWS),
                                 filename="small.jsonl")
        assert small.state == "queued"


def test_a_tenant_past_max_jobs_in_flight_gets_429_and_others_do_not(redis_url, tmp_path) -> None:
    with limited(redis_url, tmp_path, max_jobs_in_flight=2) as api, \
            Client(api.url, api_key="acme-secret") as acme, \
            Client(api.url, api_key="globex-secret") as globex:
        first = acme.jobs.create(spec(api, "1.jsonl", idempotency_key="first"))
        acme.jobs.create(spec(api, "2.jsonl"))
        with pytest.raises(ApiError) as refused:
            acme.jobs.create(spec(api, "3.jsonl"))
        assert refused.value.status_code == 429
        assert "tenant 'acme' already has 2 job(s)" in refused.value.message
        assert "max_jobs_in_flight" in refused.value.message
        assert acme.jobs.create(spec(api, "1.jsonl", idempotency_key="first")).job_id == first.job_id
        assert globex.jobs.create(spec(api, "g.jsonl", "globex")).tenant == "globex"
        acme.jobs.cancel(first.job_id)  # one ended: room again
        assert acme.jobs.create(spec(api, "3.jsonl")).state == "queued"


def test_a_key_past_max_requests_per_s_gets_429_with_retry_after(redis_url, tmp_path) -> None:
    with limited(redis_url, tmp_path, max_requests_per_s=5) as api:
        headers = {"Authorization": "Bearer acme-secret"}
        with httpx.Client(base_url=api.url, headers=headers) as http:  # kept alive: many per second
            answers = [http.get("/jobs") for _ in range(40)]
        refused = [answer for answer in answers if answer.status_code == 429]
        assert refused and all(answer.headers["Retry-After"] == "1" for answer in refused)
        assert "max_requests_per_s" in refused[0].json()["detail"]
        assert sum(answer.status_code == 200 for answer in answers) >= 5
        assert all(httpx.get(f"{api.url}/healthz").status_code == 200 for _ in range(10))
        other = httpx.get(f"{api.url}/jobs", headers={"Authorization": "Bearer globex-secret"})
        assert other.status_code == 200  # counted per key


def test_a_schedule_submits_no_more_than_its_tenants_max_jobs_in_flight(redis_url, tmp_path) -> None:
    """Its jobs are its tenant's: past the limit a tick defers the rest, says why, and a later tick
    submits them once jobs have ended."""
    with limited(redis_url, tmp_path, max_jobs_in_flight=2) as api, \
            Client(api.url, api_key="acme-secret") as acme:
        running = acme.jobs.create(spec(api, "by-hand.jsonl"))
        for name in ("a", "b", "c"):
            api.put_tenant_input("acme", f"daily/{name}.jsonl", ROWS)
        schedule = acme.schedules.create(cron="0 * * * *", input_prefix=api.tenant_uri("acme", "daily/"),
                                         job={"model": "tiny", "prompt_column": "q"})
        first = acme.schedules.tick(schedule)
        assert len(first.submitted) == 1 and first.deferred == 2
        assert "max_jobs_in_flight" in first.error and "tenant 'acme'" in first.error
        assert "max_jobs_in_flight" in acme.schedules.get(schedule).runtime.last_error
        assert sum(1 for job in acme.jobs.list() if job.state == "queued") == 2  # never past the limit
        acme.jobs.cancel(running.job_id)
        acme.jobs.cancel(first.submitted[0].job_id)
        second = acme.schedules.tick(schedule)
        assert [item.key.rsplit("/", 1)[1] for item in second.submitted] == ["b.jsonl", "c.jsonl"]
        assert second.deferred == 0 and second.error is None


def test_a_job_asking_more_than_max_tokens_cap_is_400_naming_the_cap(redis_url, tmp_path) -> None:
    """The cap bounds a row that sets no max_tokens; a job asking past it is refused, not cut."""
    with limited(redis_url, tmp_path, max_tokens_cap=512) as api, \
            Client(api.url, api_key="acme-secret") as acme:
        with pytest.raises(ApiError) as refused:
            acme.jobs.create(spec(api, "long.jsonl", sampling={"max_tokens": 513}))
        assert refused.value.status_code == 400
        assert "sampling.max_tokens 513 is more than this deployment's max_tokens_cap (512)" \
            in refused.value.message
        assert acme.jobs.create(spec(api, "capped.jsonl", sampling={"max_tokens": 512})).state == "queued"
        assert acme.jobs.create(spec(api, "unset.jsonl")).state == "queued"  # no max_tokens: not refused

"""Tenants over real HTTP: every job and schedule belongs to the tenant whose key created it;
another tenant gets 404 for it and never sees it listed; an admin key sees all."""

from __future__ import annotations

import hashlib
import io
import json

import httpx
import pytest

from api.client import ApiError, Client
from jobs.settings import Settings
from tests.api.conftest import MODELS, serve

ROWS = b'{"q": "def f(x):"}\n{"q": "class A:"}\n'
GLOBEX_KEY = "globex-secret"
# globex's key is configured as its digest, as a config file would hold it.
KEYS = f"acme=acme-secret,globex=sha256:{hashlib.sha256(GLOBEX_KEY.encode()).hexdigest()}"


@pytest.fixture
def api(redis_url, tmp_path):
    settings = Settings(broker_url=redis_url, store_uri=str(tmp_path / "store"), models=json.dumps(MODELS),
                        api_keys=KEYS, admin_api_keys="root-secret")
    with serve(settings) as running:
        yield running


def spec(api, name: str, **fields) -> dict:  # noqa: ANN003
    return {"input_uri": api.put_input(name, ROWS), "model": "tiny", "prompt_column": "q", **fields}


def not_found(call) -> ApiError:  # noqa: ANN001
    with pytest.raises(ApiError) as refused:
        call()
    assert refused.value.status_code == 404, refused.value.message
    return refused.value


def test_a_tenants_jobs_are_invisible_to_another_tenant_and_visible_to_an_admin(api) -> None:
    with Client(api.url, api_key="acme-secret") as acme, Client(api.url, api_key=GLOBEX_KEY) as globex, \
            Client(api.url, api_key="root-secret") as admin:
        # A tenant named in the body is replaced by the caller's.
        mine = acme.jobs.create(spec(api, "a.jsonl", tenant="globex"))
        theirs = globex.jobs.create(spec(api, "g.jsonl"))
        assert (mine.tenant, theirs.tenant) == ("acme", "globex")
        assert acme.jobs.spec(mine.job_id).tenant == "acme"
        for call in (lambda: globex.jobs.get(mine.job_id), lambda: globex.jobs.spec(mine.job_id),
                     lambda: globex.jobs.cancel(mine.job_id), lambda: globex.jobs.result_parts(mine.job_id)):
            assert mine.job_id in not_found(call).message  # as if it did not exist
        raw = httpx.get(f"{api.url}/jobs/{mine.job_id}/results?download=true",
                        headers={"Authorization": f"Bearer {GLOBEX_KEY}"})
        assert raw.status_code == 404
        assert [job.job_id for job in acme.jobs.list()] == [mine.job_id]
        assert [job.job_id for job in globex.jobs.list()] == [theirs.job_id]
        assert [job.job_id for job in globex.jobs.list(status="queued")] == [theirs.job_id]
        assert {job.job_id for job in admin.jobs.list()} == {mine.job_id, theirs.job_id}
        assert admin.jobs.get(mine.job_id).tenant == "acme"
        assert acme.jobs.cancel(mine.job_id).state == "cancelled"  # the owner still can


def test_listing_one_tenant_pages_through_the_others_jobs(api) -> None:
    with Client(api.url, api_key="acme-secret") as acme, Client(api.url, api_key=GLOBEX_KEY) as globex:
        acme_ids = [acme.jobs.create(spec(api, f"a{n}.jsonl")).job_id for n in range(5)]
        for n in range(7):
            globex.jobs.create(spec(api, f"g{n}.jsonl"))
        listed = [job.job_id for job in acme.jobs.list(page_size=2)]
    assert listed == acme_ids[::-1]  # newest first, every page only acme's


def test_idempotency_keys_are_per_tenant(api) -> None:
    with Client(api.url, api_key="acme-secret") as acme, Client(api.url, api_key=GLOBEX_KEY) as globex:
        first = acme.jobs.create(spec(api, "i.jsonl", idempotency_key="nightly-2026-12-01"))
        again = acme.jobs.create(spec(api, "i.jsonl", idempotency_key="nightly-2026-12-01"))
        other = globex.jobs.create(spec(api, "i.jsonl", idempotency_key="nightly-2026-12-01"))
    assert first.job_id == again.job_id != other.job_id
    assert other.tenant == "globex"


def test_a_tenants_schedules_are_invisible_to_another_tenant(api) -> None:
    body = {"cron": "0 * * * *", "input_prefix": api.input_uri("sched/"),
            "job": {"model": "tiny", "prompt_column": "q"}}
    api.put_input("sched/x.jsonl", ROWS)
    with Client(api.url, api_key="acme-secret") as acme, Client(api.url, api_key=GLOBEX_KEY) as globex, \
            Client(api.url, api_key="root-secret") as admin:
        schedule = acme.schedules.create(body)
        assert schedule.tenant == "acme"
        assert globex.schedules.list() == [] and [s.id for s in admin.schedules.list()] == [schedule.id]
        headers = {"Authorization": f"Bearer {GLOBEX_KEY}"}
        for method, path in (("GET", ""), ("POST", "/pause"), ("POST", "/tick"), ("GET", "/jobs"),
                             ("DELETE", "")):
            response = httpx.request(method, f"{api.url}/schedules/{schedule.id}{path}", headers=headers)
            assert response.status_code == 404, (method, path, response.text)
        report = acme.schedules.tick(schedule.id)
        [job_id] = [job.job_id for job in acme.jobs.list()]
        assert report.submitted and acme.jobs.get(job_id).tenant == "acme"  # its jobs are acme's
        assert list(globex.jobs.list()) == []


def test_the_schema_and_its_page_need_a_key_when_keys_are_set(api) -> None:
    for path in ("/openapi.json", "/docs"):
        assert httpx.get(f"{api.url}{path}").status_code == 401
        answer = httpx.get(f"{api.url}{path}", headers={"Authorization": "Bearer acme-secret"})
        assert answer.status_code == 200
    assert "/jobs" in httpx.get(f"{api.url}/openapi.json",
                                headers={"Authorization": "Bearer acme-secret"}).json()["paths"]


@pytest.fixture
def ruled_api(redis_url, tmp_path):
    root = tmp_path / "store"
    rules = {"acme": [str(root / "inputs" / "acme")], "globex": [str(root / "inputs" / "globex")]}
    settings = Settings(broker_url=redis_url, store_uri=str(root), models=json.dumps(MODELS),
                        api_keys=KEYS, admin_api_keys="root-secret", tenant_prefixes=json.dumps(rules))
    with serve(settings) as running:
        yield running


def test_a_tenant_reads_and_writes_only_under_its_prefixes(ruled_api) -> None:
    api = ruled_api
    with Client(api.url, api_key="acme-secret") as acme, Client(api.url, api_key="root-secret") as admin:
        ok = acme.jobs.create(spec(api, "acme/rows.jsonl", output_uri=api.input_uri("acme/out/")))
        assert ok.tenant == "acme"
        for fields, field in [({"name": "globex/rows.jsonl"}, "input_uri"),
                              ({"name": "acme-evil/rows.jsonl"}, "input_uri"),  # a prefix is a folder
                              ({"name": "acme/r.jsonl", "output_uri": api.input_uri("globex/out/")},
                               "output_uri")]:
            name = fields.pop("name")
            with pytest.raises(ApiError) as refused:
                acme.jobs.create(spec(api, name, **fields))
            assert refused.value.status_code == 403 and refused.value.message.startswith(field)
            message = refused.value.message
            assert "tenant 'acme' may use" in message and "tenant_prefixes" in message
        assert admin.jobs.create(spec(api, "globex/any.jsonl")).tenant is None  # admins are not limited
        # Uploads live in the job's own folder: no rule needed.
        uploaded = acme.jobs.create({"model": "tiny", "prompt_column": "q"}, file=io.BytesIO(ROWS),
                                    filename="up.jsonl")
        assert uploaded.tenant == "acme"


def test_an_output_folder_holds_one_jobs_parts(api) -> None:
    with Client(api.url, api_key="acme-secret") as acme:
        folder = api.input_uri("shared-out/")
        first = acme.jobs.create(spec(api, "one.jsonl", output_uri=folder, idempotency_key="one"))
        again = acme.jobs.create(spec(api, "one.jsonl", output_uri=folder, idempotency_key="one"))
        assert again.job_id == first.job_id  # the same job may come back to its folder
        with pytest.raises(ApiError) as refused:
            acme.jobs.create(spec(api, "two.jsonl", output_uri=folder))
        assert refused.value.status_code == 409 and first.job_id in refused.value.message
        inside = str(api.settings.local_store_root() / "jobs" / first.job_id / "output")
        with pytest.raises(ApiError) as refused:
            acme.jobs.create(spec(api, "three.jsonl", output_uri=inside))
        assert refused.value.status_code == 403 and "jobs/ folder" in refused.value.message

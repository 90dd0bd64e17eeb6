"""Tenants over real HTTP: every job and schedule belongs to the tenant whose key created it;
another tenant gets 404 for it and never sees it listed; an admin key sees all."""

from __future__ import annotations

import hashlib
import io
import json

import httpx
import pytest

from bulkinfer.api.client import ApiError, Client
from bulkinfer.jobs.settings import Settings
from tests.api.conftest import BUCKET, MODELS, serve

ROWS = b'{"q": "def f(x):"}\n{"q": "class A:"}\n'
JOB = {"model": "tiny", "prompt_column": "q"}
GLOBEX_KEY = "globex-secret"
# globex's key is configured as its digest, as a config file would hold it.
KEYS = f"acme=acme-secret,globex=sha256:{hashlib.sha256(GLOBEX_KEY.encode()).hexdigest()}"


@pytest.fixture
def api(redis_url, tmp_path):
    settings = Settings(broker_url=redis_url, store_uri=str(tmp_path / "store"), models=json.dumps(MODELS),
                        api_keys=KEYS, admin_api_keys="root-secret")
    with serve(settings) as running:
        yield running


def spec(api, name: str, owner: str | None = None, **fields) -> dict:  # noqa: ANN003
    """A job spec over rows put in `owner`'s own folder (or, with no owner, under inputs/)."""
    uri = api.put_tenant_input(owner, name, ROWS) if owner else api.put_input(name, ROWS)
    return {"input_uri": uri, "model": "tiny", "prompt_column": "q", **fields}


def not_found(call) -> ApiError:  # noqa: ANN001
    with pytest.raises(ApiError) as refused:
        call()
    assert refused.value.status_code == 404, refused.value.message
    return refused.value


def test_a_tenants_jobs_are_invisible_to_another_tenant_and_visible_to_an_admin(api) -> None:
    with Client(api.url, api_key="acme-secret") as acme, Client(api.url, api_key=GLOBEX_KEY) as globex, \
            Client(api.url, api_key="root-secret") as admin:
        # A tenant named in the body is replaced by the caller's.
        mine = acme.jobs.create(spec(api, "a.jsonl", "acme", tenant="globex"))
        theirs = globex.jobs.create(spec(api, "g.jsonl", "globex"))
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
        acme_ids = [acme.jobs.create(spec(api, f"a{n}.jsonl", "acme")).job_id for n in range(5)]
        for n in range(7):
            globex.jobs.create(spec(api, f"g{n}.jsonl", "globex"))
        listed = [job.job_id for job in acme.jobs.list(page_size=2)]
    assert listed == acme_ids[::-1]  # newest first, every page only acme's


def test_idempotency_keys_are_per_tenant(api) -> None:
    with Client(api.url, api_key="acme-secret") as acme, Client(api.url, api_key=GLOBEX_KEY) as globex:
        first = acme.jobs.create(spec(api, "i.jsonl", "acme", idempotency_key="nightly-2026-12-01"))
        again = acme.jobs.create(spec(api, "i.jsonl", "acme", idempotency_key="nightly-2026-12-01"))
        other = globex.jobs.create(spec(api, "i.jsonl", "globex", idempotency_key="nightly-2026-12-01"))
    assert first.job_id == again.job_id != other.job_id
    assert other.tenant == "globex"


def test_a_tenants_schedules_are_invisible_to_another_tenant(api) -> None:
    body = {"cron": "0 * * * *", "input_prefix": api.tenant_uri("acme", "sched/"),
            "job": {"model": "tiny", "prompt_column": "q"}}
    api.put_tenant_input("acme", "sched/x.jsonl", ROWS)
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
        folder = api.tenant_uri("acme", "shared-out/")
        first = acme.jobs.create(spec(api, "one.jsonl", "acme", output_uri=folder, idempotency_key="one"))
        again = acme.jobs.create(spec(api, "one.jsonl", "acme", output_uri=folder, idempotency_key="one"))
        assert again.job_id == first.job_id  # the same job may come back to its folder
        with pytest.raises(ApiError) as refused:
            acme.jobs.create(spec(api, "two.jsonl", "acme", output_uri=folder))
        assert refused.value.status_code == 409 and first.job_id in refused.value.message
        inside = str(api.settings.local_store_root() / "jobs" / first.job_id / "output")
        with pytest.raises(ApiError) as refused:
            acme.jobs.create(spec(api, "three.jsonl", "acme", output_uri=inside))
        assert refused.value.status_code == 403 and "jobs/ folder" in refused.value.message


def refused(call, status: int = 403) -> str:  # noqa: ANN001
    with pytest.raises(ApiError) as caught:
        call()
    assert caught.value.status_code == status, caught.value.message
    return caught.value.message


@pytest.fixture(params=["local", "s3"])
def keyed_api(request, redis_url, tmp_path):
    """Two tenants and an admin, no tenant_prefixes: each tenant's default rules, on either store."""
    fields = {"broker_url": redis_url, "models": json.dumps(MODELS), "api_keys": KEYS,
              "admin_api_keys": "root-secret"}
    if request.param == "local":
        settings = Settings(store_uri=str(tmp_path / "store"), **fields)
    else:
        s3 = request.getfixturevalue("s3")
        s3.client().create_bucket(Bucket=BUCKET)
        settings = Settings(store_uri=f"s3://{BUCKET}/deploy", s3_endpoint_url=s3.endpoint_url, **fields)
    with serve(settings) as running:
        yield running


def store_uri(api, key: str) -> str:
    """A key under the job store, as a URI a spec may name."""
    if api.settings.is_local_store:
        return str(api.settings.local_store_root() / key)
    return f"{api.settings.store_uri}/{key}"


def put_in_store(api, key: str, data: bytes) -> str:  # noqa: ANN001
    return api.put_uri(store_uri(api, key), data)


def test_no_key_reads_the_job_stores_own_files_but_a_tenant_reads_its_own_uploads(keyed_api) -> None:
    api = keyed_api
    with Client(api.url, api_key="acme-secret") as acme, Client(api.url, api_key=GLOBEX_KEY) as globex, \
            Client(api.url, api_key="root-secret") as admin:
        theirs = globex.jobs.create({"model": "tiny", "prompt_column": "q"}, file=io.BytesIO(ROWS),
                                    filename="g.jsonl")
        upload = store_uri(api, f"jobs/{theirs.job_id}/input/g.jsonl")
        # globex's output part, as a worker writes it: readable as rows, never as an input.
        output = put_in_store(api, f"jobs/{theirs.job_id}/output/part-00000.jsonl", ROWS)
        schedule = put_in_store(api, "schedules/rows.jsonl", ROWS)
        model = put_in_store(api, "models/tiny/rows.jsonl", ROWS)
        # A prefix KV block (worker/kv/store.py) holds another tenant's prompt, in KV form.
        kv_block = put_in_store(api, "kv/0f1e/float32/tp0of1/b16/9a8b", ROWS)
        for client in (acme, globex, admin):
            for uri, area in ((output, "jobs/"), (schedule, "schedules/"), (model, "models/"),
                              (kv_block, "kv/")):
                message = refused(lambda: client.jobs.create({**JOB, "input_uri": uri}))  # noqa: B023
                assert message.startswith("input_uri") and f"job store's {area} folder" in message
        message = refused(lambda: acme.jobs.create({**JOB, "input_uri": upload}))
        assert "upload of one of your own jobs" in message  # globex's upload is globex's
        assert globex.jobs.create({**JOB, "input_uri": upload}).tenant == "globex"
        assert admin.jobs.create({**JOB, "input_uri": upload}).tenant is None


def test_no_key_names_an_uploaded_file_or_a_batch_record_as_a_jobs_input_or_output(keyed_api) -> None:
    """/v1 files are reached through their routes, which check the owner: a job naming where one
    is kept (its own tenant's included) is refused, so no tenant reads another's upload that way."""
    api = keyed_api
    uploaded = httpx.post(f"{api.url}/v1/files", headers={"Authorization": f"Bearer {GLOBEX_KEY}"},
                          files={"purpose": (None, b"batch"), "file": ("g.jsonl", ROWS)})
    assert uploaded.status_code == 200, uploaded.text
    content = store_uri(api, f"files/globex/{uploaded.json()['id']}/content")
    batch = put_in_store(api, "batches/openai/globex/batch_x.json", ROWS)
    with Client(api.url, api_key="acme-secret") as acme, Client(api.url, api_key=GLOBEX_KEY) as globex, \
            Client(api.url, api_key="root-secret") as admin:
        for client in (acme, globex, admin):
            for uri, area in ((content, "files/"), (batch, "batches/")):
                message = refused(lambda: client.jobs.create({**JOB, "input_uri": uri}))  # noqa: B023
                assert message.startswith("input_uri") and f"job store's {area} folder" in message
        inside_files = store_uri(api, "files/x/")
        message = refused(lambda: admin.jobs.create(spec(api, "o.jsonl", output_uri=inside_files)))
        assert message.startswith("output_uri") and "job store's files/ folder" in message
        message = refused(lambda: admin.schedules.create({"cron": "0 * * * *", "job": JOB,
                                                          "input_prefix": store_uri(api, "batches/")}))
        assert message.startswith("input_prefix") and "job store's batches/ folder" in message


def test_with_keys_a_tenant_reads_only_its_own_folder_by_default(keyed_api) -> None:
    api = keyed_api
    with Client(api.url, api_key="acme-secret") as acme, Client(api.url, api_key="root-secret") as admin:
        assert acme.jobs.create(spec(api, "mine.jsonl", "acme")).tenant == "acme"
        others = (api.put_tenant_input("globex", "theirs.jsonl", ROWS), api.put_input("shared.jsonl", ROWS))
        for uri in others:
            message = refused(lambda: acme.jobs.create({**JOB, "input_uri": uri}))  # noqa: B023
            assert message.startswith("input_uri") and "tenant 'acme' may use" in message
            assert api.tenant_uri("acme", "") in message and "tenant_prefixes" in message
            assert admin.jobs.create({**JOB, "input_uri": uri}).tenant is None  # admins as before
        message = refused(lambda: acme.jobs.create(spec(api, "o.jsonl", "acme",
                                                        output_uri=api.tenant_uri("globex", "out/"))))
        assert message.startswith("output_uri") and "tenant 'acme' may use" in message
        prefix = {"cron": "0 * * * *", "job": JOB}
        api.put_tenant_input("globex", "daily/x.jsonl", ROWS)
        message = refused(lambda: acme.schedules.create(
            {**prefix, "input_prefix": api.tenant_uri("globex", "daily/")}))
        assert message.startswith("input_prefix") and "tenant 'acme' may use" in message
        message = refused(lambda: admin.schedules.create({**prefix, "input_prefix": store_uri(api, "jobs/")}))
        assert "job store's jobs/ folder" in message


def test_a_local_path_is_checked_where_it_really_points(ruled_api) -> None:
    api = ruled_api
    api.put_input("globex/rows.jsonl", ROWS)
    sneaky = api.input_uri("acme/../globex/rows.jsonl")  # textually under acme's prefix
    with Client(api.url, api_key="acme-secret") as acme:
        message = refused(lambda: acme.jobs.create({**JOB, "input_uri": sneaky}))
    assert "tenant 'acme' may use" in message


def test_an_output_folder_holds_nothing_but_its_jobs_parts(keyed_api) -> None:
    """A folder over another job's folder (or the store's own) would let its finalize clean up
    another job's unfinished uploads: refused, as is a folder inside another job's."""
    api = keyed_api
    with Client(api.url, api_key="acme-secret") as acme, Client(api.url, api_key="root-secret") as admin:
        first = acme.jobs.create(spec(api, "1.jsonl", "acme", output_uri=api.tenant_uri("acme", "out/a/")))
        inside = f"output folder of job {first.job_id}"
        for folder, says in (("out/", "not empty"), ("out/a/deeper/", inside)):
            message = refused(lambda: acme.jobs.create(  # noqa: B023
                spec(api, "2.jsonl", "acme", output_uri=api.tenant_uri("acme", folder))), 409)  # noqa: B023
            assert message.startswith("output_uri") and says in message
        api.put_tenant_input("acme", "data/rows.jsonl", ROWS)  # files that are no job's
        message = refused(lambda: acme.jobs.create(spec(api, "3.jsonl", "acme",
                                                        output_uri=api.tenant_uri("acme", "data/"))), 409)
        assert "not empty" in message
        for root in (store_uri(api, ""), store_uri(api, "models/")):
            message = refused(lambda: admin.jobs.create(spec(api, "4.jsonl", "acme", output_uri=root)))  # noqa: B023
            assert message.startswith("output_uri") and "job store's" in message
        assert acme.jobs.create(spec(api, "5.jsonl", "acme", output_uri=api.tenant_uri("acme", "out/b/")))

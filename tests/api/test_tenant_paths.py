"""Where a tenant may read and write, compared as the stores read it: a `..` segment, a `file://`
spelling or a schedule prefix without its final '/' never reaches past the folders a tenant has,
and a folder another tenant's job holds is refused without naming that job."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from bulkinfer.api.client import Client
from bulkinfer.jobs.settings import Settings
from tests.api.conftest import MODELS, RunningApi, refused, serve

ROWS = b'{"q": "def f(x):"}\n{"q": "class A:"}\n'
ACME, GLOBEX = {"api_key": "acme-secret"}, {"api_key": "globex-secret"}


def place(api: RunningApi, name: str, data: bytes = ROWS) -> str:
    """A file at `name` under the local store's root; its path."""
    path = api.settings.local_store_root() / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return str(path)


def folder(api: RunningApi, name: str) -> str:
    return f"{api.settings.local_store_root() / name}/"


@pytest.fixture
def ruled_api(redis_url, tmp_path):
    """acme and globex, each with its folder under tenants/ and both with shared/."""
    root = tmp_path / "store"
    rules = {tenant: [f"{root}/tenants/{tenant}/", f"{root}/shared/"] for tenant in ("acme", "globex")}
    settings = Settings(broker_url=redis_url, store_uri=str(root), models=json.dumps(MODELS),
                        api_keys="acme=acme-secret,globex=globex-secret", tenant_prefixes=json.dumps(rules))
    with serve(settings) as running:
        yield running


def job(input_uri: str, **fields) -> dict:  # noqa: ANN003
    return {"input_uri": input_uri, "model": "tiny", "prompt_column": "q", **fields}


def test_a_dot_dot_segment_does_not_reach_another_tenants_folder(ruled_api) -> None:
    api = ruled_api
    secret = place(api, "tenants/globex/secret.jsonl")
    own = place(api, "tenants/acme/rows.jsonl")
    sneaky = secret.replace("/tenants/globex/", "/tenants/acme/../globex/")
    assert Path(sneaky).resolve() == Path(secret)
    with Client(api.url, **ACME) as acme:
        for uri in (sneaky, sneaky.replace("/../", "/./../")):
            error = refused(lambda uri=uri: acme.jobs.create(job(uri)))
            assert error.status_code in (400, 403) and error.message.startswith("input_uri"), error.message
        body = {"cron": "0 * * * *", "input_prefix": str(Path(sneaky).parent) + "/",
                "job": {"model": "tiny", "prompt_column": "q"}}
        error = refused(lambda: acme.schedules.create(body))
        assert error.status_code in (400, 403) and error.message.startswith("input_prefix"), error.message
        assert list(acme.jobs.list()) == [] and acme.schedules.list() == []
        assert acme.jobs.create(job("file://" + own)).tenant == "acme"  # a file:// spelling of its own file


def test_a_schedule_prefix_must_end_inside_the_tenants_folder(ruled_api) -> None:
    api = ruled_api
    place(api, "tenants/acme-evil/theirs.jsonl")  # beside acme's folder, its name starting the same
    place(api, "tenants/acme/mine.jsonl")
    body = {"cron": "0 * * * *", "input_prefix": folder(api, "tenants/acme").rstrip("/"),
            "job": {"model": "tiny", "prompt_column": "q"}}
    with Client(api.url, **ACME) as acme:
        error = refused(lambda: acme.schedules.create(body))
        assert error.status_code == 400 and "end it with '/'" in error.message, error.message
        schedule = acme.schedules.create({**body, "input_prefix": folder(api, "tenants/acme")})
        [submitted] = acme.schedules.tick(schedule.id).submitted  # its own file, not acme-evil/'s
        assert submitted.key.endswith("tenants/acme/mine.jsonl")


def test_a_claimed_output_folder_does_not_name_another_tenants_job(ruled_api) -> None:
    api = ruled_api
    out = folder(api, "shared/out")
    with Client(api.url, **ACME) as acme, Client(api.url, **GLOBEX) as globex:
        mine = acme.jobs.create(job(place(api, "tenants/acme/rows.jsonl"), output_uri=out))
        theirs = place(api, "tenants/globex/rows.jsonl")
        error = refused(lambda: globex.jobs.create(job(theirs, output_uri=out)))
        assert error.status_code == 409 and "another job" in error.message, error.message
        assert mine.job_id not in error.message
        error = refused(lambda: acme.jobs.create(job(place(api, "tenants/acme/two.jsonl"), output_uri=out)))
        assert error.status_code == 409 and mine.job_id in error.message  # its own job is named


def test_a_schedule_that_no_longer_reads_is_still_its_owners_alone(ruled_api) -> None:
    from bulkinfer.jobs.scheduling.schedules import ScheduleRepository

    api = ruled_api
    place(api, "tenants/acme/in/x.jsonl")
    with Client(api.url, **ACME) as acme:
        schedule = acme.schedules.create({"cron": "0 * * * *", "input_prefix": folder(api, "tenants/acme/in"),
                                          "job": {"model": "tiny", "prompt_column": "q"}})
    schedules = ScheduleRepository.beside(api.repository)
    data = json.loads(schedules.store.get_bytes(schedules._key(schedule.id)))
    data["job"]["input_uri"] = "s3://bucket/x.jsonl"  # a template refused since it was stored
    schedules.store.put_bytes(schedules._key(schedule.id), json.dumps(data).encode())
    url = f"{api.url}/schedules/{schedule.id}"
    other = {"Authorization": "Bearer globex-secret"}
    for method in ("GET", "DELETE"):
        assert httpx.request(method, url, headers=other).status_code == 404
    assert httpx.get(url, headers={"Authorization": "Bearer acme-secret"}).status_code == 409
    assert httpx.delete(url, headers={"Authorization": "Bearer acme-secret"}).status_code == 204

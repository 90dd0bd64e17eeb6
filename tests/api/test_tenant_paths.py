"""Where a tenant may read, compared as the stores read it: a `..` segment, a `file://` spelling or
a schedule prefix without its final '/' never reaches past the folders `tenant_prefixes` gives it."""

from __future__ import annotations

import json

import pytest

from api.client import ApiError, Client
from jobs.settings import Settings
from tests.api.conftest import MODELS, serve
from tests.api.test_tenants import GLOBEX_KEY, KEYS, ROWS, ruled_api  # noqa: F401 - ruled_api: a fixture


@pytest.fixture
def keyed_local_api(redis_url, tmp_path):
    """Keys for acme and globex, no tenant_prefixes rule (the default)."""
    settings = Settings(broker_url=redis_url, store_uri=str(tmp_path / "store"), models=json.dumps(MODELS),
                        api_keys=KEYS)
    with serve(settings) as running:
        yield running


def refused(call) -> ApiError:  # noqa: ANN001
    with pytest.raises(ApiError) as error:
        call()
    return error.value


def test_a_dot_dot_segment_does_not_reach_another_tenants_folder(ruled_api) -> None:  # noqa: F811
    api = ruled_api
    api.put_input("globex/secret.jsonl", ROWS)
    api.put_input("acme/rows.jsonl", ROWS)
    with Client(api.url, api_key="acme-secret") as acme:
        for name in ("acme/../globex/secret.jsonl", "acme/./../globex/secret.jsonl"):
            error = refused(lambda name=name: acme.jobs.create(
                {"input_uri": api.input_uri(name), "model": "tiny", "prompt_column": "q"}))
            assert error.status_code == 400 and "'..' segment" in error.message, error.message
        body = {"cron": "0 * * * *", "input_prefix": api.input_uri("acme/../globex") + "/",
                "job": {"model": "tiny", "prompt_column": "q"}}
        error = refused(lambda: acme.schedules.create(body))
        assert error.status_code == 400 and error.message.startswith("input_prefix"), error.message
        assert list(acme.jobs.list()) == [] and acme.schedules.list() == []
        # Its own folder, spelled as a file:// URI, is still its own.
        own = acme.jobs.create({"input_uri": "file://" + api.input_uri("acme/rows.jsonl"), "model": "tiny",
                                "prompt_column": "q"})
        assert own.tenant == "acme"


def test_a_schedule_prefix_must_end_inside_the_tenants_folder(ruled_api) -> None:  # noqa: F811
    api = ruled_api
    api.put_input("acme-evil/theirs.jsonl", ROWS)  # a folder beside acme's whose name starts the same
    body = {"cron": "0 * * * *", "input_prefix": api.input_uri("acme"),
            "job": {"model": "tiny", "prompt_column": "q"}}
    with Client(api.url, api_key="acme-secret") as acme:
        error = refused(lambda: acme.schedules.create(body))
        assert error.status_code == 400 and "end it with '/'" in error.message, error.message
        schedule = acme.schedules.create({**body, "input_prefix": api.input_uri("acme") + "/"})
        assert acme.schedules.tick(schedule.id).submitted == []  # acme-evil/ is not listed


def test_a_claimed_output_folder_does_not_name_another_tenants_job(keyed_local_api) -> None:
    api = keyed_local_api
    folder = api.input_uri("shared") + "/out/"
    rows = api.put_input("rows.jsonl", ROWS)
    with Client(api.url, api_key="acme-secret") as acme, Client(api.url, api_key=GLOBEX_KEY) as globex:
        mine = acme.jobs.create({"input_uri": rows, "model": "tiny", "prompt_column": "q",
                                 "output_uri": folder})
        error = refused(lambda: globex.jobs.create({"input_uri": rows, "model": "tiny", "prompt_column": "q",
                                                    "output_uri": folder}))
        assert error.status_code == 409 and "another job" in error.message, error.message
        assert mine.job_id not in error.message
        error = refused(lambda: acme.jobs.create({"input_uri": rows, "model": "tiny", "prompt_column": "q",
                                                  "output_uri": folder}))
        assert error.status_code == 409 and mine.job_id in error.message  # its own job is named

"""Which priorities a tenant may use is the deployment's choice (`tenant_max_priority`, default
`normal`): a job or schedule asking for more is refused with 403 naming the rule, over real HTTP."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from bulkinfer.jobs.settings import Settings
from tests.api.conftest import MODELS, RunningApi, serve

KEYS = {"acme": "acme-key", "vip": "vip-key"}
ADMIN_KEY = "admin-key"
ROWS = b'{"q": "hello"}\n'


@pytest.fixture
def api(redis_url, tmp_path) -> Iterator[RunningApi]:
    settings = Settings(broker_url=redis_url, store_uri=str(tmp_path / "store"), models=json.dumps(MODELS),
                        api_keys=",".join(f"{tenant}={key}" for tenant, key in KEYS.items()),
                        admin_api_keys=ADMIN_KEY, tenant_max_priority={"vip": 8})
    with serve(settings) as running:
        yield running


def _submit(api: RunningApi, key: str, priority: object) -> httpx.Response:
    owner = next((tenant for tenant, tenant_key in KEYS.items() if tenant_key == key), "acme")
    body = {"input_uri": api.put_tenant_input(owner, "rows.jsonl", ROWS), "model": "tiny",
            "prompt_column": "q", "priority": priority}
    return httpx.post(f"{api.url}/jobs", json=body, headers={"Authorization": f"Bearer {key}"})


def test_a_tenant_cannot_jump_the_queue_by_asking_a_high_priority(api: RunningApi) -> None:
    for priority in (9, "high", 6):
        refused = _submit(api, KEYS["acme"], priority)
        assert refused.status_code == 403, refused.text
        assert "above the highest tenant 'acme' may use (5)" in refused.json()["detail"]
        assert "tenant_max_priority" in refused.json()["detail"]
    for priority in ("normal", "low", 0):
        assert _submit(api, KEYS["acme"], priority).status_code == 201
    assert api.repository.list(tenant="acme")[0][0].tenant == "acme"


def test_a_listed_tenant_may_go_to_its_own_cap_and_an_admin_anywhere(api: RunningApi) -> None:
    assert _submit(api, KEYS["vip"], "high").status_code == 201
    refused = _submit(api, KEYS["vip"], 9)
    assert refused.status_code == 403 and "(8)" in refused.json()["detail"]
    assert _submit(api, ADMIN_KEY, 9).status_code == 201


def test_a_schedule_cannot_submit_jobs_above_its_tenants_cap(api: RunningApi) -> None:
    api.put_tenant_input("acme", "sched/x.jsonl", ROWS)
    body = {"cron": "0 * * * *", "input_prefix": api.tenant_uri("acme", "sched/"),
            "job": {"model": "tiny", "prompt_column": "q", "priority": "high"}}
    headers = {"Authorization": f"Bearer {KEYS['acme']}"}
    refused = httpx.post(f"{api.url}/schedules", json=body, headers=headers)
    assert refused.status_code == 403 and "tenant_max_priority" in refused.json()["detail"]
    body["job"]["priority"] = "normal"
    assert httpx.post(f"{api.url}/schedules", json=body, headers=headers).status_code == 201

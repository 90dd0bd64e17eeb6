"""API keys over real HTTP: with `api_keys` set every route but /healthz needs a Bearer key; the SDK
and the CLI send theirs; refusals are 401s that say what was wrong."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest

from bulkinfer.api.client import ApiError, Client
from bulkinfer.jobs.settings import Settings
from tests.api.conftest import MODELS, serve
from tests.fixtures.services import REPO_ROOT

KEYS = "first-key, second-key"


@pytest.fixture
def api(redis_url, tmp_path):
    settings = Settings(broker_url=redis_url, store_uri=str(tmp_path / "store"), models=json.dumps(MODELS),
                        api_keys=KEYS)
    with serve(settings) as running:
        yield running


@pytest.mark.parametrize(("headers", "message"), [
    ({}, "this API needs an API key: send 'Authorization: Bearer <key>'"),
    ({"Authorization": "Basic Zmlyc3Qta2V5"}, "the Authorization header must be 'Bearer <key>'"),
    ({"Authorization": "Bearer nope"}, "the API key is not valid"),
])
def test_a_missing_malformed_or_unknown_key_is_a_401_saying_which(api, headers, message) -> None:
    for method, path in (("GET", "/jobs"), ("GET", "/models"), ("POST", "/jobs"), ("GET", "/schedules")):
        response = httpx.request(method, f"{api.url}{path}", headers=headers, json={})
        assert response.status_code == 401, (method, path, response.text)
        assert response.json()["detail"].startswith(message)
        assert response.headers["WWW-Authenticate"] == "Bearer"
        assert "nope" not in response.text  # the key given is never echoed


def test_each_configured_key_opens_every_route_and_health_stays_open(api) -> None:
    assert httpx.get(f"{api.url}/healthz").status_code == 200
    for key in ("first-key", "second-key"):
        with Client(api.url, api_key=key) as client:
            assert sorted(client.models()) == sorted(MODELS)
            assert list(client.jobs.list()) == []
    with Client(api.url) as anonymous, pytest.raises(ApiError) as refused:
        list(anonymous.jobs.list())
    assert refused.value.status_code == 401 and "needs an API key" in refused.value.message


def test_the_cli_sends_its_key_from_the_flag_or_the_environment(api) -> None:
    def cli(*args: str, **env: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "bulkinfer.api.cli", "list", "--json", "--api-url", api.url, *args]
        return subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
                              env={**os.environ, "PYTHONPATH": str(REPO_ROOT), **env})

    assert cli("--api-key", "second-key").returncode == 0
    assert cli(BULKINFER_API_KEY="first-key").returncode == 0
    refused = cli()
    assert refused.returncode == 2 and "401" in refused.stderr and "needs an API key" in refused.stderr


def test_wrong_keys_past_the_limit_get_429_and_a_known_key_goes_on(redis_url, tmp_path) -> None:
    settings = Settings(broker_url=redis_url, store_uri=str(tmp_path / "store"), models=json.dumps(MODELS),
                        api_keys=KEYS, max_auth_failures_per_min=5)
    if 60 - time.time() % 60 < 10:  # the count is per minute: start well inside one
        time.sleep(60 - time.time() % 60)
    with serve(settings) as api, httpx.Client(base_url=api.url) as http:
        def get(key: str | None) -> httpx.Response:
            return http.get("/jobs", headers={"Authorization": f"Bearer {key}"} if key else {})

        assert all(get("first-key").status_code == 200 for _ in range(20))  # valid keys never count
        assert [get(f"guess-{n}").status_code for n in range(5)] == [401] * 5
        refused = get("guess-5")
        assert refused.status_code == 429 and "max_auth_failures_per_min" in refused.json()["detail"]
        assert 1 <= int(refused.headers["Retry-After"]) <= 60
        assert get("second-key").status_code == 429  # a guess that happens to be right gains nothing now
        assert get("first-key").status_code == 200  # a key this address used before goes on
        assert get(None).status_code == 401  # no key: nothing guessed, not limited

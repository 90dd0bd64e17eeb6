"""`bulkinfer serve api` serves the API from BULKINFER_* settings, as an operator would run it."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from tests.fixtures.services import REPO_ROOT, free_port, wait_until


@pytest.mark.timeout(120)
def test_serve_api_answers_healthz_with_its_redis_and_store(redis_url: str, tmp_path) -> None:
    port = free_port()
    env = {**os.environ, "BULKINFER_BROKER_URL": redis_url, "BULKINFER_STORE_URI": str(tmp_path / "store")}
    process = subprocess.Popen([sys.executable, "-m", "api.cli", "serve", "api", "--port", str(port)],
                               cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}/healthz"
        wait_until(lambda: httpx.get(url, timeout=1).status_code == 200, timeout=60, what="serve api")
        body = httpx.get(url, timeout=5).json()
        assert body["status"] == "ok"
        assert body["checks"] == {"redis": "ok", "store": "ok"}
    finally:
        process.terminate()
        process.wait(timeout=20)

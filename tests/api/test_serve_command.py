"""`bulkinfer serve api` and `serve all` serve from their settings, as an operator would run them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from celery import Celery

from tests.fixtures.services import REPO_ROOT, ServiceDied, free_port, wait_until


@pytest.mark.timeout(120)
def test_serve_api_answers_healthz_with_its_redis_and_store(redis_url: str, tmp_path) -> None:
    port = free_port()
    env = {**os.environ, "BULKINFER_BROKER_URL": redis_url, "BULKINFER_STORE_URI": str(tmp_path / "store")}
    process = subprocess.Popen([sys.executable, "-m", "bulkinfer.api.cli", "serve", "api", "--port",
                                str(port)],
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


@pytest.mark.timeout(240)
def test_serve_all_runs_the_api_and_a_worker_that_runs_a_job(redis_url: str, tiny_checkpoint: Path,
                                                              tmp_path: Path) -> None:
    """Settings from a config file (models, store) and the environment (Redis); a job goes through."""
    port, node = free_port(), f"serve-all-{os.getpid()}@127.0.0.1"
    store = tmp_path / "store"
    config = tmp_path / "bulkinfer.toml"
    config.write_text(f'store_uri = "{store}"\nreaper_interval_s = 5\n'
                      f'[models]\ntiny = "{tiny_checkpoint}"\n[engine_options]\nmax_model_len = 256\n')
    env = {**os.environ, "BULKINFER_BROKER_URL": redis_url, "HF_HUB_OFFLINE": "1"}
    env.pop("BULKINFER_MODELS", None)
    command = [sys.executable, "-m", "bulkinfer.api.cli", "serve", "all", "--config", str(config), "--port",
               str(port),
               "-n", node, "--worker-log", str(tmp_path / "worker.log")]
    log = tmp_path / "serve.log"  # a file, not a pipe: access logs would fill a pipe nobody reads
    output = log.open("wb")
    process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=output, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    control = Celery(broker=redis_url)
    try:
        def up() -> bool:
            if process.poll() is not None:
                raise ServiceDied(f"serve all exited with {process.returncode}: {log.read_text()[-3000:]}")
            return httpx.get(f"{url}/healthz", timeout=1).json()["status"] == "ok"

        wait_until(up, timeout=60, what="serve all's API")
        wait_until(lambda: control.control.ping(destination=[node], timeout=0.5), timeout=120,
                   what="serve all's worker")
        queues = control.control.inspect(destination=[node], timeout=2).active_queues()[node]
        assert sorted(queue["name"] for queue in queues) == ["bulkinfer.control", "bulkinfer.model.tiny"]

        (store / "inputs").mkdir(parents=True)
        source = store / "inputs" / "rows.jsonl"
        source.write_text("".join(json.dumps({"q": f"question {i}"}) + "\n" for i in range(3)))
        spec = {"input_uri": str(source), "model": "tiny", "prompt_column": "q",
                "sampling": {"max_tokens": 2}}
        job = httpx.post(f"{url}/jobs", json=spec, timeout=10)
        assert job.status_code in (200, 201), job.text
        job_id = job.json()["job_id"]

        def finished() -> bool:
            return httpx.get(f"{url}/jobs/{job_id}", timeout=5).json()["state"] == "succeeded"

        wait_until(finished, timeout=120, what="the job", interval=0.2)
        assert httpx.get(f"{url}/jobs/{job_id}", timeout=5).json()["rows"]["succeeded"] == 3
    finally:
        control.close()
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
        output.close()
    assert process.returncode == 0, log.read_text()[-3000:]


@pytest.mark.parametrize("command", ["serve api", "serve all", "up"])
def test_a_bad_config_file_stops_a_server_command_with_the_key_named(
        command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from bulkinfer.api.cli import main

    config = tmp_path / "bulkinfer.toml"
    config.write_text('broker_url = "redis://127.0.0.1:1/0"\napi_prot = 8001\n')
    assert main([*command.split(), "--config", str(config)]) == 2
    assert f"{config}: unknown key 'api_prot'" in capsys.readouterr().err


def test_serve_all_refuses_a_model_it_does_not_serve(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from bulkinfer.api.cli import main

    config = tmp_path / "bulkinfer.toml"
    config.write_text('[models]\ntiny = "/models/tiny"\n')
    assert main(["serve", "all", "--config", str(config), "--model", "big"]) == 2
    assert "model 'big' is not served here (served: tiny)" in capsys.readouterr().err


def test_up_takes_the_tensor_parallel_size_flag_as_the_setting(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    from bulkinfer.api.cli import main

    assert main(["up", "--home", str(tmp_path), "--tensor-parallel-size", "0"]) == 2
    assert "--tensor-parallel-size: Input should be greater than or equal to 1" in capsys.readouterr().err

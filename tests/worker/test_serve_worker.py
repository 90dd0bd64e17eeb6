"""`bulkinfer serve worker`: the Celery arguments it builds, and a real start answering pings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from celery import Celery

from bulkinfer.jobs.model_registry import ModelRegistry, UnknownModel
from bulkinfer.worker.process.main import parse_args, serve_worker, worker_argv
from tests.fixtures.services import REPO_ROOT, RedisServer, ServiceDied, wait_until

REGISTRY = ModelRegistry({"tiny": "/models/tiny", "small": "s3://models/small"})


def test_every_registry_model_and_the_control_queue_by_default() -> None:
    argv, models = worker_argv(parse_args([]), REGISTRY)
    assert models == ["small", "tiny"]
    assert argv == ["worker", "--pool=threads", "--concurrency=2", "-Q",
                    "bulkinfer.control,bulkinfer.model.small,bulkinfer.model.tiny", "--loglevel=INFO"]


def test_chosen_models_without_control_tasks() -> None:
    argv, models = worker_argv(parse_args(["--model", "tiny", "--no-control", "--concurrency", "3",
                                           "-n", "gpu0@host"]), REGISTRY)
    assert models == ["tiny"]
    assert argv == ["worker", "--pool=threads", "--concurrency=3", "-Q", "bulkinfer.model.tiny",
                    "--loglevel=INFO", "-n", "gpu0@host"]


def test_an_unknown_model_or_an_empty_registry_is_refused() -> None:
    with pytest.raises(UnknownModel, match="served: small, tiny"):
        worker_argv(parse_args(["--model", "gpt-9"]), REGISTRY)
    with pytest.raises(ValueError, match="BULKINFER_MODELS"):
        worker_argv(parse_args([]), ModelRegistry())


def test_serve_worker_exits_with_a_usage_error_for_an_unknown_model(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("BULKINFER_MODELS", json.dumps({"tiny": "/models/tiny"}))
    assert serve_worker(["--model", "gpt-9"]) == 2
    assert "model 'gpt-9' is not served here (served: tiny)" in capsys.readouterr().out


@pytest.mark.timeout(120)
def test_serve_worker_runs_a_worker_on_the_model_queues(redis_server: RedisServer, tiny_checkpoint: Path,
                                                        tmp_path: Path) -> None:
    node = f"serve-{os.getpid()}@127.0.0.1"
    env = {**os.environ, "BULKINFER_BROKER_URL": redis_server.url, "PYTHONPATH": str(REPO_ROOT),
           "BULKINFER_MODELS": json.dumps({"tiny": str(tiny_checkpoint)}), "HF_HUB_OFFLINE": "1",
           "BULKINFER_STORE_URI": str(tmp_path / "store")}
    # `python -m bulkinfer.worker` is `bulkinfer serve worker` (worker/__main__.py)
    process = subprocess.Popen([sys.executable, "-m", "bulkinfer.worker", "--no-preload", "-n", node],
                               cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    control = Celery(broker=redis_server.url)

    def answers() -> bool:
        if process.poll() is not None:
            raise ServiceDied(f"serve_worker exited with {process.returncode}")
        return bool(control.control.ping(destination=[node], timeout=0.5))

    try:
        wait_until(answers, timeout=60, what="serve_worker's worker")
        queues = control.control.inspect(destination=[node], timeout=2).active_queues()[node]
        assert sorted(queue["name"] for queue in queues) == ["bulkinfer.control", "bulkinfer.model.tiny"]
    finally:
        control.close()
        process.terminate()
        process.wait(timeout=30)


def test_a_plain_celery_worker_reads_the_config_file_under_its_environment(tmp_path: Path) -> None:
    config = tmp_path / "bulkinfer.toml"
    config.write_text('broker_url = "redis://127.0.0.1:6390/3"\nshard_lease_ttl_s = 12.5\n'
                      '[engine_options]\nnum_kv_blocks = 48\n')
    # What the worker's modules are handed: the process's settings, read once (nothing exported).
    probe = ("import json; from bulkinfer.worker.process.celery_app import app; from bulkinfer.jobs.settings "
             "import process_settings; "
             "settings = process_settings(); "
             "print(json.dumps([app.conf.broker_url, settings.engine_options, str(settings.lease_ttl)]))")
    base = {key: value for key, value in os.environ.items() if not key.startswith("BULKINFER_")}

    def imported_with(**variables: str) -> list:
        result = subprocess.run([sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True,
                                env={**base, "PYTHONPATH": str(REPO_ROOT), "BULKINFER_CONFIG": str(config),
                                     **variables}, timeout=60, check=True)
        return json.loads(result.stdout.strip().splitlines()[-1])

    assert imported_with() == ["redis://127.0.0.1:6390/3", '{"num_kv_blocks": 48}', "12.5"]
    # A variable beats the file, as everywhere else.
    assert imported_with(BULKINFER_BROKER_URL="redis://127.0.0.1:6391/0")[0] == "redis://127.0.0.1:6391/0"

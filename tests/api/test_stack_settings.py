"""`bulkinfer up` runs its API and its worker on the settings the user gave (variables, config file,
flags), with only the stack's own (its Redis, its store, the models it prepared) over them: a default
never replaces a setting the user gave. The processes are not started: the worker's command and
environment are caught where `up` would spawn it, and read back as the worker reads them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bulkinfer.api.cli import stack as stack_module
from bulkinfer.api.cli.stack import Stack, StackError
from bulkinfer.api.cli.stack_commands import up
from bulkinfer.jobs.settings import Settings


class _Exited:
    """A child that has already exited: stopping it does nothing."""

    pid = 0
    returncode = 0

    def poll(self) -> int:
        return 0


def _launch_up(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Run `bulkinfer up argv` until it would spawn its worker: what the worker and the API get."""
    seen: dict[str, Any] = {}

    def spawn(stack: Stack, command: list[str], log: Path, extra: dict[str, str] | None = None) -> _Exited:
        if log.name != "worker.log":
            return _Exited()  # redis-server
        seen.update(command=command, env=stack._child_env(extra or {}), api=stack.settings)
        raise StackError("stopped by the test before the worker starts")

    monkeypatch.setattr(Stack, "_spawn", spawn)
    monkeypatch.setattr(stack_module, "wait_for", lambda *_args, **_kwargs: None)
    assert up(argv) == 1
    assert seen, "up never started its worker"
    return seen


def test_up_gives_the_worker_and_the_api_every_setting_the_user_gave(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # no ./bulkinfer.toml: the worker reads only what `up` hands it
    monkeypatch.delenv("BULKINFER_CONFIG", raising=False)
    config = tmp_path / "user.toml"
    config.write_text('shard_window_rows = 7\nlog_format = "json"\nworker_concurrency = 3\n'
                      'store_uri = "s3://not-used/by-up"\n')
    for name, value in {"BULKINFER_KV_STORE": "on", "BULKINFER_SHARE_PREFIX_CACHE_ACROSS_TENANTS": "true",
                        "BULKINFER_MAX_SHARD_SIZE": "123", "BULKINFER_KV_STORE_MIN_HITS": "5"}.items():
        monkeypatch.setenv(name, value)
    home = tmp_path / "home"

    seen = _launch_up(["--preset", "tiny", "--port", "0", "--home", str(home), "--config", str(config),
                       "--dtype", "float32", "--api-keys", "acme=acme-key"], monkeypatch)

    worker = Settings.from_env(seen["env"])  # as the worker process reads its settings
    for settings in (worker, seen["api"]):
        assert settings.kv_store == "on"  # not the default, auto
        assert settings.share_prefix_cache_across_tenants is True
        assert (settings.max_shard_size, settings.kv_store_min_hits) == (123, 5)
        assert (settings.shard_window_rows, settings.log_format) == (7, "json")  # the config file's
        assert settings.api_keys == "acme=acme-key"  # a flag's
        assert settings.engine_options_dict()["dtype"] == "float32"
        # The stack's own over the user's: its Redis, its store, the model it serves.
        assert settings.store_uri == str(home.resolve() / "store")
        assert settings.broker_url.startswith("redis://127.0.0.1:") and settings.broker_url != \
            Settings().broker_url
        assert settings.model_registry().names() == ["tiny"]
    assert "--concurrency=3" in seen["command"]  # worker_concurrency: the worker's task threads

"""Settings from flags, BULKINFER_* variables and the config file, and the model registry the API
checks models against."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from bulkinfer.jobs.model_registry import ModelRegistry, UnknownModel
from bulkinfer.jobs.object_store import LocalObjectStore, S3ObjectStore
from bulkinfer.jobs.settings import DEFAULT_BROKER_URL, ENVIRONMENT_NAMES, ConfigError, Settings
from bulkinfer.jobs.settings_args import add_settings_arguments, settings_from_args


def test_settings_come_from_the_environment_and_go_back_to_it(tmp_path) -> None:
    environ = {"BULKINFER_BROKER_URL": "redis://127.0.0.1:7000/1", "BULKINFER_STORE_URI": str(tmp_path),
               "BULKINFER_MODELS": "", "UNRELATED": "x"}
    settings = Settings.from_env(environ)
    assert settings.broker_url == "redis://127.0.0.1:7000/1" and settings.models is None
    assert Settings.from_env(settings.to_env()) == settings
    assert Settings.from_env({}, broker_url=None).broker_url == DEFAULT_BROKER_URL
    assert Settings.from_env({}, store_uri="s3://b/p").store_uri == "s3://b/p"


def test_the_store_is_a_local_directory_or_a_bucket_with_a_prefix(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    store, prefix = Settings(store_uri="./data/store").open_store()
    assert isinstance(store, LocalObjectStore) and store.root == tmp_path / "data" / "store" and prefix == ""
    store, prefix = Settings(store_uri="s3://bucket/team/a/", s3_endpoint_url="http://127.0.0.1:9").open_store()
    assert isinstance(store, S3ObjectStore) and (store.bucket, prefix) == ("bucket", "team/a")
    with pytest.raises(ValidationError, match="no bucket"):
        Settings(store_uri="s3:///x")
    with pytest.raises(ValidationError, match="s3://bucket/prefix or a local directory"):
        Settings(store_uri="gs://bucket")


def test_the_model_registry_reads_json_or_a_file_and_names_served_models(tmp_path) -> None:
    registry = ModelRegistry.parse('{"tiny": "/models/tiny", "qwen/small": "s3://m/small"}')
    assert registry.names() == ["qwen/small", "tiny"] and "tiny" in registry
    assert registry.location("tiny") == "/models/tiny"
    assert registry.queue_for("qwen/small") == "bulkinfer.model.qwen/small"
    with pytest.raises(UnknownModel, match=r"model 'big' is not served here \(served: qwen/small, tiny\)"):
        registry.queue_for("big")

    path = tmp_path / "models.json"
    path.write_text(json.dumps({"tiny": "/models/tiny"}))
    assert ModelRegistry.from_env({"BULKINFER_MODELS": str(path)}).names() == ["tiny"]
    assert Settings(models=str(path)).model_registry().names() == ["tiny"]
    with pytest.raises(UnknownModel, match="none: set BULKINFER_MODELS"):
        ModelRegistry.from_env({}).location("tiny")


@pytest.mark.parametrize(("value", "message"), [
    ("{not json", "not JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"a b": "/x"}', "without spaces"),
    ('{"a": ""}', "location must be"),
    ("/no/such/models.json", "cannot read /no/such/models.json"),
])
def test_a_bad_model_registry_says_what_is_wrong(value, message) -> None:
    with pytest.raises(ValueError, match=message):
        ModelRegistry.parse(value)


def _config(tmp_path, text: str):
    path = tmp_path / "bulkinfer.toml"
    path.write_text(text)
    return path


def test_flags_beat_the_environment_which_beats_the_config_file_which_beats_defaults(tmp_path) -> None:
    path = _config(tmp_path, 'broker_url = "redis://file:6379/0"\nstore_uri = "/file/store"\n'
                             'api_port = 9000\nworker_concurrency = 3\n'
                             '[models]\ntiny = "/models/tiny"\n[engine_options]\nmax_model_len = 512\n')
    environ = {"BULKINFER_CONFIG": str(path), "BULKINFER_STORE_URI": "/env/store",
               "BULKINFER_API_PORT": "9100"}
    settings = Settings.from_env(environ, api_port=9200)
    assert settings.broker_url == "redis://file:6379/0"  # file only
    assert settings.store_uri == "/env/store"  # env over file
    assert settings.api_port == 9200  # flag over env
    assert settings.worker_concurrency == 3 and settings.api_host == "127.0.0.1"  # file; default
    # Tables are kept as the JSON text the variables hold, so a child process gets the same settings.
    assert settings.model_registry().location("tiny") == "/models/tiny"
    assert settings.engine_options_dict() == {"max_model_len": 512}
    assert Settings.from_env({**settings.to_env(), "BULKINFER_CONFIG": ""}) == settings
    # An explicit --config wins over BULKINFER_CONFIG.
    other = tmp_path / "other.toml"
    other.write_text('broker_url = "redis://other:6379/0"\n')
    assert Settings.from_env(environ, config=other).broker_url == "redis://other:6379/0"


def test_bulkinfer_toml_in_the_working_directory_is_read_when_present(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert Settings.from_env({}) == Settings()
    _config(tmp_path, 'shard_lease_ttl_s = 12.5\n')
    assert Settings.from_env({}).shard_lease_ttl_s == 12.5
    assert Settings.from_env({}).to_env()["BULKINFER_SHARD_LEASE_TTL_S"] == "12.5"


@pytest.mark.parametrize(("text", "message"), [
    ('brokr_url = "redis://x"\n', r"bulkinfer.toml: unknown key 'brokr_url' \(known keys: broker_url, "),
    ("[api]\nport = 1\n", "bulkinfer.toml: unknown key 'api'"),
    ("api_port = 70000\n", r"bulkinfer.toml: key 'api_port': Input should be less than or equal to 65535"),
    ('store_uri = "gs://b"\n', "bulkinfer.toml: key 'store_uri': store URI must be s3://bucket/prefix"),
    ('engine_options = "[1]"\n', "key 'engine_options': must be a JSON object"),
    ("api_port = \n", "bulkinfer.toml: not valid TOML"),
])
def test_a_bad_config_file_names_the_file_and_the_key(tmp_path, text, message) -> None:
    path = _config(tmp_path, text)
    with pytest.raises(ConfigError, match=message):
        Settings.from_env({}, config=path)


def test_a_bad_variable_or_flag_names_it_and_a_missing_config_file_is_an_error(tmp_path) -> None:
    with pytest.raises(ConfigError, match="variable BULKINFER_WORKER_CONCURRENCY: .*greater than"):
        Settings.from_env({"BULKINFER_WORKER_CONCURRENCY": "0"})
    with pytest.raises(ConfigError, match="--api-port: Input should be a valid integer"):
        Settings.from_env({}, api_port="x")
    with pytest.raises(ConfigError, match=f"BULKINFER_CONFIG: no config file at {tmp_path}/missing.toml"):
        Settings.from_env({"BULKINFER_CONFIG": str(tmp_path / "missing.toml")})


def test_command_flags_map_onto_settings(tmp_path) -> None:
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser, ["broker_url", "api_port", "shard_lease_ttl_s"])
    path = _config(tmp_path, 'broker_url = "redis://file:6379/0"\napi_port = 9000\n')
    args = parser.parse_args(["--config", str(path), "--port", "9001", "--shard-lease-ttl-s", "4"])
    settings = settings_from_args(args)
    assert settings.broker_url == "redis://file:6379/0"  # from the file
    assert (settings.api_port, settings.shard_lease_ttl_s) == (9001, 4.0)  # from flags (--port: an alias)


def test_the_dtype_setting_takes_only_the_engine_dtypes_and_overrides_engine_options(tmp_path) -> None:
    settings = Settings.from_env({"BULKINFER_ENGINE_OPTIONS": '{"dtype": "float16", "max_num_seqs": 8}'},
                                 dtype="bfloat16")
    assert settings.engine_options_dict() == {"dtype": "bfloat16", "max_num_seqs": 8}
    assert Settings.from_env({}).engine_options_dict() == {}  # unset: each engine picks "auto"
    with pytest.raises(ConfigError, match="variable BULKINFER_DTYPE: Input should be 'auto', 'float32'"):
        Settings.from_env({"BULKINFER_DTYPE": "fp8"})
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser, ["dtype"])
    assert settings_from_args(parser.parse_args(["--dtype", "float16"])).dtype == "float16"
    with pytest.raises(SystemExit):  # argparse lists the choices
        parser.parse_args(["--dtype", "half"])


def test_every_setting_is_documented_in_the_configuration_page() -> None:
    page = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    for field, variable in ENVIRONMENT_NAMES.items():
        flag = f"--{field.replace('_', '-')}"
        assert f"| `{field}` | `{variable}` | `{flag}`" in page, f"{field} is not in docs/configuration.md"


def test_the_speculative_config_setting_reaches_the_engine_options() -> None:
    settings = Settings(engine_options='{"max_num_seqs": 8, "speculative_config": {"method": "draft_model"}}',
                        speculative_config='{"method": "ngram", "num_speculative_tokens": 3}')
    assert settings.engine_options_dict() == {
        "max_num_seqs": 8, "speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}
    with pytest.raises(ValueError, match="must be a JSON object"):
        Settings(speculative_config='["ngram"]')


def test_the_tensor_parallel_size_setting_reaches_the_engine_options_from_flag_or_environment() -> None:
    options = '{"tensor_parallel_size": 4, "max_num_seqs": 8}'
    settings = Settings.from_env({"BULKINFER_ENGINE_OPTIONS": options, "BULKINFER_TENSOR_PARALLEL_SIZE": "2"})
    assert settings.engine_options_dict() == {"tensor_parallel_size": 2, "max_num_seqs": 8}
    assert "tensor_parallel_size" not in Settings.from_env({}).engine_options_dict()
    with pytest.raises(ConfigError, match="variable BULKINFER_TENSOR_PARALLEL_SIZE: Input should be greater"):
        Settings.from_env({"BULKINFER_TENSOR_PARALLEL_SIZE": "0"})
    for parsed in _parsed_by_worker_and_run_flags(["--tensor-parallel-size", "2"]):
        assert parsed.engine_options_dict()["tensor_parallel_size"] == 2


def _parsed_by_worker_and_run_flags(argv: list[str]) -> list[Settings]:
    """The settings `serve worker`'s flags and `run`'s make of ``argv``."""
    from bulkinfer.jobs.settings_args import WORKER_SETTINGS
    from bulkinfer.worker.run.run_cli import RUN_SETTINGS

    parsed = []
    for fields in (WORKER_SETTINGS, RUN_SETTINGS):
        parser = argparse.ArgumentParser()
        add_settings_arguments(parser, fields)
        parsed.append(settings_from_args(parser.parse_args(argv)))
    return parsed


def test_the_kv_store_is_on_for_a_deployment_with_a_bucket_and_off_for_bulkinfer_run_unless_asked(
        tmp_path) -> None:
    bucket = Settings(store_uri="s3://jobs/prod")
    assert bucket.kv_store == "auto"
    assert bucket.kv_store_enabled(deployment=True)  # serve worker, up with S3
    assert not bucket.kv_store_enabled(deployment=False)  # bulkinfer run
    assert not Settings(store_uri=str(tmp_path)).kv_store_enabled(deployment=True)  # no bucket
    asked = Settings.from_env({"BULKINFER_KV_STORE": "on"}, store_uri=str(tmp_path))
    assert asked.kv_store_enabled(deployment=False) and asked.kv_store_enabled(deployment=True)
    refused = Settings.from_env({}, store_uri="s3://jobs/prod", kv_store="off")
    assert not refused.kv_store_enabled(deployment=True)
    with pytest.raises(ConfigError, match="BULKINFER_KV_STORE: Input should be 'auto', 'on' or 'off'"):
        Settings.from_env({"BULKINFER_KV_STORE": "yes"})


def test_kv_blocks_live_in_the_job_store_unless_kv_store_uri_says_elsewhere_with_a_disk_cache_by_models(
        tmp_path) -> None:
    settings = Settings(store_uri="s3://jobs/prod", model_cache=str(tmp_path / "models"))
    assert settings.kv_store_location == "s3://jobs/prod"
    assert settings.kv_cache_dir == tmp_path / "models" / "kv"  # in the worker's model volume
    assert (settings.kv_min_hits, settings.kv_cache_bytes) == (2, 10 << 30)
    assert settings.kv_store_budget_bytes is None
    store, prefix = settings.open_kv_store()
    assert isinstance(store, S3ObjectStore) and (store.bucket, prefix) == ("jobs", "prod")
    elsewhere = Settings.from_env({"BULKINFER_KV_STORE_URI": str(tmp_path / "kv-store"),
                                   "BULKINFER_KV_STORE_MIN_HITS": "3", "BULKINFER_KV_STORE_CACHE_BYTES": "0",
                                   "BULKINFER_KV_STORE_CACHE_DIR": str(tmp_path / "disk"),
                                   "BULKINFER_KV_STORE_BUDGET_BYTES": "1000000"}, store_uri="s3://jobs/prod")
    store, prefix = elsewhere.open_kv_store()
    assert isinstance(store, LocalObjectStore) and store.root == tmp_path / "kv-store" and prefix == ""
    assert (elsewhere.kv_min_hits, elsewhere.kv_cache_bytes) == (3, 0)
    assert elsewhere.kv_store_budget_bytes == 1_000_000
    assert elsewhere.kv_cache_dir == tmp_path / "disk"
    assert Settings.from_env(elsewhere.to_env()) == elsewhere  # a worker child gets the same
    with pytest.raises(ConfigError, match="BULKINFER_KV_STORE_URI: store URI must be s3://bucket/prefix"):
        Settings.from_env({"BULKINFER_KV_STORE_URI": "gs://kv"})
    with pytest.raises(ConfigError, match="--kv-store-min-hits: Input should be greater than or equal to 1"):
        Settings.from_env({}, kv_store_min_hits=0)
    from bulkinfer.jobs.settings_args import WORKER_SETTINGS
    from bulkinfer.worker.run.run_cli import RUN_SETTINGS

    for fields in (WORKER_SETTINGS, RUN_SETTINGS):  # `serve worker` and `run` take the flags
        parser = argparse.ArgumentParser()
        add_settings_arguments(parser, fields)
        parsed = settings_from_args(parser.parse_args(["--kv-store", "on", "--kv-store-uri", str(tmp_path)]))
        assert parsed.kv_store_enabled(deployment=False) and parsed.kv_store_location == str(tmp_path)


def test_a_deployment_can_turn_batch_invariance_off_or_on_from_flag_or_environment() -> None:
    """Off gives back its cost on CPU; on asks for it on a GPU (where the engine's default is off)."""
    options = '{"batch_invariant": true, "max_num_seqs": 8}'
    settings = Settings.from_env({"BULKINFER_ENGINE_OPTIONS": options, "BULKINFER_BATCH_INVARIANT": "false"})
    assert settings.engine_options_dict() == {"batch_invariant": False, "max_num_seqs": 8}
    assert "batch_invariant" not in Settings.from_env({}).engine_options_dict()  # the engine decides
    with pytest.raises(ConfigError, match="BULKINFER_BATCH_INVARIANT: Input should be a valid boolean"):
        Settings.from_env({"BULKINFER_BATCH_INVARIANT": "sometimes"})
    from bulkinfer.worker.hosts.model_hosts import engine_options

    for parsed in _parsed_by_worker_and_run_flags(["--batch-invariant", "true"]):
        assert engine_options(parsed.engine_options_dict())["batch_invariant"] is True

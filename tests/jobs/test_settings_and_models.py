"""Settings from BULKINFER_* variables, and the model registry the API checks models against."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from jobs.models import ModelRegistry, UnknownModel
from jobs.object_store import LocalObjectStore, S3ObjectStore
from jobs.settings import DEFAULT_BROKER_URL, Settings


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

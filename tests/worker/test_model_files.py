"""Model locations: a local directory as it is, an S3 prefix downloaded once into the cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from bulkinfer.jobs.model_presets import PRESET_NAMES
from bulkinfer.worker.models.model_files import (
    COMPLETE_MARKER,
    ModelUnavailable,
    built_preset,
    local_model_dir,
)
from tests.fixtures.services import S3Server


def test_a_local_directory_is_used_in_place(tiny_checkpoint: Path) -> None:
    assert local_model_dir(str(tiny_checkpoint)) == tiny_checkpoint
    assert local_model_dir(f"file://{tiny_checkpoint}") == tiny_checkpoint


def test_a_preset_name_is_the_one_cached_checkpoint_every_command_means(
        tiny_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from bulkinfer.engine.checkpoints import PRESETS

    assert set(PRESET_NAMES) == set(PRESETS)  # the CLI's names (no torch) are the engine's presets
    monkeypatch.chdir(tmp_path)
    assert local_model_dir("tiny") == tiny_checkpoint  # built once: the tests' own tiny checkpoint
    assert built_preset("tiny") == tiny_checkpoint
    (tmp_path / "tiny").mkdir()  # a folder of that name here is a location, not the preset
    with pytest.raises(ModelUnavailable, match="config.json does not exist"):
        local_model_dir("tiny")


def test_a_local_directory_without_a_model_says_where_it_looked(tmp_path: Path) -> None:
    with pytest.raises(ModelUnavailable, match="config.json does not exist"):
        local_model_dir(str(tmp_path))


def test_an_s3_model_is_downloaded_once_then_reused(s3: S3Server, tiny_checkpoint: Path,
                                                    tmp_path: Path) -> None:
    client = s3.client()
    client.create_bucket(Bucket="models")
    for path in tiny_checkpoint.iterdir():
        client.upload_file(str(path), "models", f"llama/tiny/{path.name}")
    cache = tmp_path / "cache"

    first = local_model_dir("s3://models/llama/tiny", cache)

    assert sorted(p.name for p in first.iterdir()) == sorted([*(p.name for p in tiny_checkpoint.iterdir()),
                                                              COMPLETE_MARKER])
    assert (first / "model.safetensors").read_bytes() == (tiny_checkpoint / "model.safetensors").read_bytes()
    client.delete_object(Bucket="models", Key="llama/tiny/config.json")
    assert local_model_dir("s3://models/llama/tiny/", cache) == first  # served from the cache
    assert [p.name for p in cache.iterdir()] == [first.name]  # no download folder left behind


def test_an_s3_prefix_without_a_model_is_unavailable(s3: S3Server, tmp_path: Path) -> None:
    s3.client().create_bucket(Bucket="models")
    s3.client().put_object(Bucket="models", Key="empty/readme.txt", Body=b"nothing here")
    with pytest.raises(ModelUnavailable, match="none is config.json"):
        local_model_dir("s3://models/empty", tmp_path)
    with pytest.raises(ModelUnavailable, match="cannot download"):
        local_model_dir("s3://no-such-bucket/x", tmp_path)
    assert list(tmp_path.iterdir()) == []

"""The catalog's embedding model: `bulkinfer models fetch all-minilm-l6-v2`, the name as a model
location, and zipped folders that must be refused."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from bulkinfer.engine.embedder import is_embedding_model
from bulkinfer.worker.models.model_catalog import CATALOG, CatalogError, _unpack_folder
from bulkinfer.worker.models.model_files import local_model_dir
from bulkinfer.worker.run.run_file import resolve_model
from tests.fixtures.checkpoints import REAL_EMBEDDING_MODEL

ROOT = Path(__file__).resolve().parents[2]


def test_models_fetch_extracts_the_folder_and_the_name_resolves(real_embedding_model: Path,
                                                                tmp_path: Path) -> None:
    target = tmp_path / "minilm"
    result = subprocess.run([sys.executable, "-m", "bulkinfer.api.cli", "models", "fetch",
                             REAL_EMBEDDING_MODEL,
                             "--dir", str(target)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                            env=dict(os.environ))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(target)
    assert "extracting model.zip" in result.stderr
    assert sorted(p.name for p in target.iterdir()) == sorted(p.name for p in real_embedding_model.iterdir())
    assert is_embedding_model(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["minilm"]  # no staging folder left behind
    assert local_model_dir(REAL_EMBEDDING_MODEL) == real_embedding_model  # `--model all-minilm-l6-v2`
    from bulkinfer.jobs.model_registry import ModelRegistry

    assert resolve_model(REAL_EMBEDDING_MODEL, ModelRegistry()) == str(real_embedding_model.resolve())
    assert CATALOG[REAL_EMBEDDING_MODEL].packaging == "folder-zip"


def _zip(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return path


@pytest.mark.parametrize("members,reason", [
    ({"config.json": b"{}", "../escape.txt": b"x"}, "would land outside the folder"),
    ({"/etc/evil": b"x", "config.json": b"{}"}, "would land outside the folder"),
    ({"model/config.json": b"{}"}, "holds no config.json at its top"),
])
def test_a_bad_zipped_folder_is_refused_and_leaves_nothing(tmp_path: Path, members: dict[str, bytes],
                                                           reason: str) -> None:
    archive = _zip(tmp_path / "model.zip", members)
    cache = tmp_path / "cache"
    with pytest.raises(CatalogError, match=reason):
        _unpack_folder(archive, cache / "m")
    assert list(cache.iterdir()) == []
    assert not (tmp_path / "escape.txt").exists()

"""`bulkinfer models list`: each served, cataloged or named model's architecture, parameters, active
parameters and weight memory per dtype and tensor-parallel size."""

from __future__ import annotations

import json

import pytest

import bulkinfer.jobs.settings
from bulkinfer.jobs.settings import Settings
from bulkinfer.worker.models.model_commands import models_cli


@pytest.fixture
def served(monkeypatch, checkpoint_factory):
    """BULKINFER_MODELS: a local Mixtral folder and a model on S3."""
    models = {"mixtral-local": str(checkpoint_factory(arch="mixtral")), "remote": "s3://models/big"}
    monkeypatch.setattr(bulkinfer.jobs.settings, "_process_settings", Settings(models=json.dumps(models)))
    return models


def test_served_models_are_sized_per_dtype_and_tp(served, capsys):
    assert models_cli(["list", "--tensor-parallel-sizes", "1,2"]) == 0
    out = capsys.readouterr().out
    section = out[out.index("mixtral-local"):]
    assert "MixtralForCausalLM: 6.23M parameters (2.10M active: 2 of 8 experts a token)" in section
    rows = {line.split()[0]: line.split()[1:] for line in section.splitlines() if line.strip().startswith(
        ("float32", "bfloat16"))}
    assert rows["float32"] == ["23.8", "MiB", "11.9", "MiB"]
    assert rows["bfloat16"] == ["11.9", "MiB", "5.9", "MiB"]
    assert "KV cache comes on top" in section
    assert "remote  s3://models/big\n  not on this machine" in out


def test_a_named_folder_of_an_unserved_architecture_says_so(served, tmp_path, capsys, checkpoint_factory):
    folder = tmp_path / "other"
    folder.mkdir()
    source = checkpoint_factory(arch="llama")
    config = json.loads((source / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["FalconForCausalLM"]}))
    (folder / "model.safetensors").write_bytes((source / "model.safetensors").read_bytes())
    assert models_cli(["list", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "FalconForCausalLM: not an architecture the engine serves (supported: " in out
    assert "MixtralForCausalLM" in out.split("supported: ")[1] and "Qwen3MoeForCausalLM" in out


def test_bad_tensor_parallel_sizes_are_refused_by_name(served, capsys):
    assert models_cli(["list", "--tensor-parallel-sizes", "1,0"]) == 1
    assert "--tensor-parallel-sizes: '1,0'" in capsys.readouterr().err

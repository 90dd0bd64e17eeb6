"""ModelHosts: one engine per model, preloaded in the background, rebuilt after a failed load."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from bulkinfer.engine import SamplingParams
from bulkinfer.jobs.model_registry import ModelRegistry, UnknownModel
from bulkinfer.jobs.settings import Settings
from bulkinfer.worker.hosts.engine_host import EngineRequest, EngineUnavailable
from bulkinfer.worker.hosts.model_hosts import ModelHosts, engine_options
from bulkinfer.worker.models.model_files import ModelUnavailable

OPTIONS = {"max_model_len": 128, "num_kv_blocks": 32}


def test_a_preloaded_model_is_ready_and_the_same_host_serves_every_shard(tiny_checkpoint: Path) -> None:
    hosts = ModelHosts(ModelRegistry({"tiny": str(tiny_checkpoint)}), OPTIONS)
    try:
        hosts.preload(["tiny"]).join(60)
        hosted = hosts.get("tiny")
        assert hosted.host.wait_ready(0) is True
        assert hosts.get("tiny") is hosted
        greedy = SamplingParams(temperature=0.0, max_tokens=3)
        submission = hosted.host.submit([EngineRequest("def f():", greedy)])
        assert submission.wait(30) and submission.results()[0].num_completion_tokens == 3
    finally:
        hosts.stop()


def test_unknown_and_missing_models_raise_with_the_reason(tmp_path: Path) -> None:
    hosts = ModelHosts(ModelRegistry({"gone": str(tmp_path / "gone")}), OPTIONS)
    with pytest.raises(UnknownModel, match="served: gone"):
        hosts.get("other")
    with pytest.raises(ModelUnavailable, match="gone"):
        hosts.get("gone")


def test_a_model_whose_engine_failed_to_load_is_loaded_again_next_time(tiny_checkpoint: Path,
                                                                      tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_checkpoint, model)
    weights = (model / "model.safetensors").read_bytes()
    (model / "model.safetensors").unlink()
    hosts = ModelHosts(ModelRegistry({"tiny": str(model)}), OPTIONS)
    try:
        broken = hosts.get("tiny")
        with pytest.raises(EngineUnavailable):
            broken.host.wait_ready(60)
        (model / "model.safetensors").write_bytes(weights)  # the files are fixed
        fixed = hosts.get("tiny")
        assert fixed is not broken and fixed.host.wait_ready(60) is True
    finally:
        hosts.stop()


def options_from(environ: dict[str, str]) -> dict:
    """The engine options a worker started with these variables runs its engines with."""
    return engine_options(Settings.from_env(environ).engine_options_dict())


def test_engine_options_come_from_the_environment_and_unknown_ones_are_refused() -> None:
    assert options_from({}) == {"scheduling_policy": "priority"}
    assert options_from({"BULKINFER_ENGINE_OPTIONS": '{"max_model_len": 64, "scheduling_policy": '
                         '"fcfs"}'}) == {"max_model_len": 64, "scheduling_policy": "fcfs"}
    with pytest.raises(ValueError, match="unknown engine option 'max_len'"):
        options_from({"BULKINFER_ENGINE_OPTIONS": '{"max_len": 64}'})
    with pytest.raises(ValueError, match="JSON object"):
        options_from({"BULKINFER_ENGINE_OPTIONS": "[1]"})


def test_the_dtype_setting_wins_over_the_engine_options_dtype() -> None:
    assert options_from({"BULKINFER_DTYPE": "bfloat16"})["dtype"] == "bfloat16"
    assert options_from({"BULKINFER_ENGINE_OPTIONS": '{"dtype": "float16"}',
                         "BULKINFER_DTYPE": "float32"})["dtype"] == "float32"
    assert options_from({"BULKINFER_ENGINE_OPTIONS": '{"dtype": "float16"}'})["dtype"] == "float16"

"""Workers and `bulkinfer run` keep dtype auto's verdict beside their model cache, and take the
`remeasure_dtype` and `cpu_isa` settings as every setting: a variable, a flag, a config key."""

from __future__ import annotations

from pathlib import Path

from bulkinfer.jobs.model_registry import ModelRegistry
from bulkinfer.jobs.settings import Settings
from bulkinfer.jobs.settings_args import WORKER_SETTINGS, settings_from_args
from bulkinfer.worker.hosts.model_hosts import ModelHosts
from bulkinfer.worker.run.run_cli import build_parser


def test_the_verdict_file_lies_beside_the_model_cache(tmp_path: Path, tiny_checkpoint: Path) -> None:
    hosts = ModelHosts(ModelRegistry({}), {}, cache_dir=tmp_path / "models")
    config = hosts.engine_config(tiny_checkpoint)
    assert config.dtype_verdicts == str(tmp_path / "models" / "cpu-dtype-verdicts.json")
    assert config.remeasure_dtype is False
    pinned = ModelHosts(ModelRegistry({}), {"dtype_verdicts": "/srv/verdicts.json"}, cache_dir=tmp_path)
    assert pinned.engine_config(tiny_checkpoint).dtype_verdicts == "/srv/verdicts.json"


def test_remeasure_dtype_reaches_the_engines(tmp_path: Path, tiny_checkpoint: Path) -> None:
    settings = Settings.from_env({"BULKINFER_REMEASURE_DTYPE": "true"})
    assert settings.engine_options_dict()["remeasure_dtype"] is True
    assert "remeasure_dtype" not in Settings.from_env({}).engine_options_dict()
    hosts = ModelHosts(ModelRegistry({}), settings.engine_options_dict(), cache_dir=tmp_path)
    assert hosts.engine_config(tiny_checkpoint).remeasure_dtype is True
    config_file = tmp_path / "bulkinfer.toml"
    config_file.write_text('remeasure_dtype = true\ncpu_isa = "avx512"\n')
    from_file = Settings.from_env({}, config=config_file)
    assert (from_file.remeasure_dtype, from_file.cpu_isa) == (True, "avx512")


def test_run_and_workers_take_the_flags() -> None:
    args = build_parser().parse_args(["in.jsonl", "-o", "out.jsonl", "--remeasure-dtype", "true",
                                      "--cpu-isa", "avx2"])
    settings = settings_from_args(args)
    assert (settings.remeasure_dtype, settings.cpu_isa) == (True, "avx2")
    assert {"remeasure_dtype", "cpu_isa"} <= set(WORKER_SETTINGS)  # serve worker, serve all

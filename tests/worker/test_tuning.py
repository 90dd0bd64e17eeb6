"""`bulkinfer tune`: the search, the tuned file, and a worker that loads a model with its settings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bulkinfer.engine.config import EngineConfig
from bulkinfer.jobs.model_registry import ModelRegistry
from bulkinfer.worker.hosts.model_hosts import ModelHosts
from bulkinfer.worker.tuning.tune_cli import tune_cli
from bulkinfer.worker.tuning.tuned_settings import (
    DEFAULTS,
    MAX_NUM_BATCHED_TOKENS,
    MAX_NUM_SEQS,
    MIN_GAIN,
    Trial,
    TuneResult,
    machine_signature,
    search,
    tuned_engine_options,
    tuned_path,
    write_tuned,
)


def fake_measure(speed, preemptions=lambda options: 0, calls=None):  # noqa: ANN001, ANN201
    def measure(options: dict) -> Trial:
        if calls is not None:
            calls.append(dict(options))
        return Trial(options, wall_s=1000 / speed(options), output_tokens=1000,
                     preemptions=preemptions(options), kv_bytes=1 << 20)
    return measure


def test_search_goes_one_setting_at_a_time_and_never_repeats_a_trial() -> None:
    calls: list[dict] = []
    # Fastest at 128 sequences and 4,096 tokens per step.
    speed = lambda o: 100 - abs(o["max_num_seqs"] - 128) / 8 - abs(o["max_num_batched_tokens"] - 4096) / 512  # noqa: E731
    result = search(fake_measure(speed, calls=calls))
    assert result.best.options == {"max_num_seqs": 128, "max_num_batched_tokens": 4096}
    keys = [json.dumps(c, sort_keys=True) for c in calls]
    assert len(keys) == len(set(keys)) == len(MAX_NUM_SEQS) + len(MAX_NUM_BATCHED_TOKENS) - 1
    assert result.default is not None and result.default.options == DEFAULTS


def test_the_search_starts_from_the_engines_own_defaults() -> None:
    # The trial `tune` compares every candidate against must be what an untuned worker runs.
    engine = EngineConfig(model="m")
    assert DEFAULTS == {"max_num_seqs": engine.max_num_seqs,
                        "max_num_batched_tokens": engine.max_num_batched_tokens}


def test_a_best_trial_that_preempted_gets_a_bigger_kv_budget_tried() -> None:
    speed = lambda o: 200 if o.get("kv_cache_memory") else 100 + o["max_num_seqs"] / 100  # noqa: E731
    result = search(fake_measure(speed, preemptions=lambda o: 0 if o.get("kv_cache_memory") else 5))
    assert result.best.options == {"max_num_seqs": 512, "max_num_batched_tokens": 512,
                                   "kv_cache_memory": 2 << 20}


def test_a_winner_within_the_noise_of_the_defaults_keeps_the_defaults() -> None:
    speed = lambda o: 102 if o["max_num_seqs"] == 128 else 100  # noqa: E731 - 2% faster: noise
    assert search(fake_measure(speed)).best.options == DEFAULTS
    speed = lambda o: 110 if o["max_num_seqs"] == 128 else 100  # noqa: E731
    assert search(fake_measure(speed)).best.options["max_num_seqs"] == 128


def test_failed_trials_lose_and_all_failing_is_an_error() -> None:
    def measure(options: dict) -> Trial:
        if options["max_num_seqs"] != 64:
            return Trial(options, 0.0, 0, error="out of memory")
        return Trial(options, 10.0, 100)
    assert search(measure).best.options["max_num_seqs"] == 64
    with pytest.raises(RuntimeError, match="every tuning trial failed; the first: boom"):
        search(lambda options: Trial(options, 0.0, 0, error="boom"))


def test_tuned_settings_apply_only_on_the_machine_they_were_measured_on(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    here = machine_signature("cpu", "auto")
    best = Trial({"max_num_seqs": 64, "max_num_batched_tokens": 1024}, 1.0, 10)
    write_tuned(tuned_path(tmp_path / "cache", model), model, here, TuneResult(best, [best]), "default")
    assert tuned_engine_options(tmp_path / "cache", model, here) == best.options
    assert tuned_engine_options(tmp_path / "cache", model, {**here, "dtype": "float32"}) == {}
    assert tuned_engine_options(tmp_path / "cache", model, {**here, "threads": 99}) == {}
    tuned_path(tmp_path / "cache", model).write_text("{not json")
    assert tuned_engine_options(tmp_path / "cache", model, here) == {}
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text('{"x": 1}')
    assert tuned_path(tmp_path / "cache", other) != tuned_path(tmp_path / "cache", model)


def test_tune_writes_the_fastest_settings_and_a_worker_loads_the_model_with_them(
        tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = tmp_path / "rows.jsonl"
    lines = [json.dumps({"text": f"item {i}: " + "word " * (i % 7)}) for i in range(12)]
    rows.write_text("\n".join(lines) + "\n")
    cache = tmp_path / "cache"
    assert tune_cli(["--model", str(tiny_checkpoint), "--workload", str(rows), "--prompt-column", "text",
                     "--max-tokens", "4", "--rows", "10", "--model-cache", str(cache),
                     "--engine-options", '{"max_model_len": 256}']) == 0
    printed = capsys.readouterr().out
    assert "10 rows" in printed and "best: {" in printed and "wrote " in printed
    document = json.loads(tuned_path(cache, tiny_checkpoint).read_text())
    assert len(document["trials"]) >= len(MAX_NUM_SEQS) + len(MAX_NUM_BATCHED_TOKENS) - 1
    assert all(t["error"] is None and t["output_tokens"] == 40 for t in document["trials"])
    best = document["engine_options"]
    fastest = max(document["trials"], key=lambda t: t["output_tokens"] / t["wall_s"])
    default = next(t for t in document["trials"] if t["options"] == DEFAULTS)
    speed = {id(t): t["output_tokens"] / t["wall_s"] for t in (fastest, default)}
    kept_defaults = speed[id(fastest)] < speed[id(default)] * (1 + MIN_GAIN)
    assert best == (DEFAULTS if kept_defaults else fastest["options"])

    hosts = ModelHosts(ModelRegistry({"tiny": str(tiny_checkpoint)}), {"max_model_len": 256}, cache_dir=cache)
    config = hosts.engine_config(tiny_checkpoint)
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (best["max_num_seqs"],
                                                                  best["max_num_batched_tokens"])
    pinned = ModelHosts(ModelRegistry({}), {"max_num_seqs": 3}, cache_dir=cache)
    explicit = pinned.engine_config(tiny_checkpoint)
    assert explicit.max_num_seqs == 3 and explicit.max_num_batched_tokens == best["max_num_batched_tokens"]


def test_tune_refuses_a_bad_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert tune_cli(["--model", str(tmp_path / "missing"), "--rows", "4"]) == 2
    assert "missing" in capsys.readouterr().err
    assert tune_cli(["--model", "x", "--rows", "0"]) == 2

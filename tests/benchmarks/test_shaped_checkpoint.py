"""Random weights in a checkpoint's shape: what the GPU check benches where real weights cannot travel."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bulkinfer.benchmarks.shaped_checkpoint import main, parse_overrides
from bulkinfer.engine import LLM, SamplingParams
from bulkinfer.engine.checkpoints import cached_checkpoint, count_parameters


def test_overrides_parse_numbers_and_name_a_malformed_item() -> None:
    assert parse_overrides(["num_hidden_layers=2", "rms_norm_eps=1e-5", "hidden_act=gelu"]) == {
        "num_hidden_layers": 2, "rms_norm_eps": 1e-5, "hidden_act": "gelu"}
    with pytest.raises(ValueError, match="'layers'"):
        parse_overrides(["layers"])


def test_a_shaped_copy_has_the_new_shape_the_same_tokenizer_and_runs_in_the_engine(tmp_path: Path) -> None:
    source = cached_checkpoint(preset="tiny")
    out = tmp_path / "shaped"
    assert main([str(source), str(out), "--set", "num_hidden_layers=2", "hidden_size=64",
                 "num_attention_heads=2", "--dtype", "float32"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["head_dim"]) == (2, 64, 32)
    assert (out / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()
    assert count_parameters(out) < count_parameters(source)
    llm = LLM(model=str(out), dtype="float32")
    [result] = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=6, ignore_eos=True))
    assert len(result.outputs[0].token_ids) == 6


def test_an_unknown_setting_is_refused_by_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(cached_checkpoint(preset="tiny")), str(tmp_path / "x"), "--set", "num_layerz=2"]) == 2
    assert "num_layerz" in capsys.readouterr().err

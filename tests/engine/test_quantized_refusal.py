"""A quantized checkpoint the engine cannot load is refused by its scheme, from config.json, before
any tensor is read (it used to stop at "unexpected tensor(s): ...weight_scale")."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bulkinfer.engine import LLM
from bulkinfer.engine.models.llama_config import UnsupportedModelError
from bulkinfer.engine.models.loader import CheckpointError
from bulkinfer.quant_scheme import quantization_scheme

# What llm-compressor writes for W8A8 int8 (its preset), and for W4A16 with groups of 128.
W8A8 = {"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"group_0": {
    "targets": ["Linear"],
    "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False},
    "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                          "dynamic": True}}}, "ignore": ["lm_head"]}
W4A16 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
    "targets": ["Linear"],
    "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}}}}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"}


@pytest.mark.parametrize("quant, named", [
    (AWQ, "awq 4-bit"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "fp8"),
])
def test_a_quantized_checkpoint_is_refused_by_its_scheme(tiny_checkpoint: Path, tmp_path: Path, quant: dict,
                                                         named: str) -> None:
    assert quantization_scheme({"quantization_config": quant}) == named
    folder = tmp_path / "quantized"
    shutil.copytree(tiny_checkpoint, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    from bulkinfer.jobs.workers import QUANTIZED_CHECKPOINT  # what the API refuses jobs by

    with pytest.raises(UnsupportedModelError, match=QUANTIZED_CHECKPOINT) as refused:
        LLM(model=str(folder), num_kv_blocks=16)
    assert named in str(refused.value)


@pytest.mark.parametrize("quant, named", [
    (W8A8, "compressed-tensors W8A8 int8 (int-quantized: channel weights, dynamic token activations)"),
    (W4A16, "compressed-tensors W4A16 int4 (pack-quantized: group 128 weights)"),
])
def test_schemes_it_runs_are_named_and_need_their_quantized_tensors(tiny_checkpoint: Path, tmp_path: Path,
                                                                    quant: dict, named: str) -> None:
    assert quantization_scheme({"quantization_config": quant}) == named
    folder = tmp_path / "declared"
    shutil.copytree(tiny_checkpoint, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    declared = "_proj is targeted by the quantization config .* stored unquantized"
    with pytest.raises(CheckpointError, match=declared):
        LLM(model=str(folder), num_kv_blocks=16)


def test_an_unquantized_config_names_no_scheme() -> None:
    assert quantization_scheme({"architectures": ["LlamaForCausalLM"]}) is None
    assert quantization_scheme({"quantization_config": None}) is None

"""The safetensors loader: single-file and sharded checkpoints, tied embeddings, named errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from bulkinfer.engine.attention import TorchPagedAttention
from bulkinfer.engine.models import CheckpointError, UnsupportedModelError, load_model
from tests.engine.hf_reference import engine_last_logits

PROMPT = [5, 99, 1000, 42, 7, 300, 12, 8]


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    for path in dst.iterdir():
        path.chmod(0o644)  # cached checkpoints are read-only
    return dst


def rewrite_tensors(model_dir: Path, edit) -> None:
    tensors = load_file(model_dir / "model.safetensors")
    edit(tensors)
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})


def rewrite_config(model_dir: Path, edit) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    edit(config)
    (model_dir / "config.json").write_text(json.dumps(config))


@pytest.fixture
def llama_copy(tmp_path, checkpoint_factory) -> Path:
    return copy_checkpoint(checkpoint_factory(arch="llama"), tmp_path / "ckpt")


def load(model_dir: Path):
    return load_model(model_dir, TorchPagedAttention())


def test_missing_tensor_is_named(llama_copy):
    rewrite_tensors(llama_copy, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\): model\.layers\.1\.mlp\.up_proj\.weight"):
        load(llama_copy)


def test_unexpected_tensor_is_named(llama_copy):
    rewrite_tensors(llama_copy, lambda t: t.update({"model.layers.0.self_attn.extra.weight": torch.zeros(3)}))
    with pytest.raises(
        CheckpointError, match=r"unexpected tensor\(s\): model\.layers\.0\.self_attn\.extra\.weight"
    ):
        load(llama_copy)


def test_wrong_shape_is_named_with_both_shapes(llama_copy):
    name = "model.layers.2.self_attn.k_proj.weight"

    def narrow(tensors):
        tensors[name] = tensors[name][:-1].clone()

    rewrite_tensors(llama_copy, narrow)
    with pytest.raises(CheckpointError, match=rf"tensor {name} has shape \(63, 128\), expected \(64, 128\)"):
        load(llama_copy)


def test_unsupported_architecture(llama_copy):
    rewrite_config(llama_copy, lambda c: c.update(architectures=["GPT2LMHeadModel"]))
    with pytest.raises(UnsupportedModelError, match="unsupported architecture.*GPT2LMHeadModel"):
        load(llama_copy)


def test_unsupported_rope_scaling(llama_copy):
    rope = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    rewrite_config(llama_copy, lambda c: c.update(rope_parameters=rope))
    with pytest.raises(UnsupportedModelError, match="rope scaling type 'yarn' is not supported"):
        load(llama_copy)


def test_no_weights_file(llama_copy):
    (llama_copy / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors or model.safetensors.index.json"):
        load(llama_copy)


def shard(model_dir: Path) -> None:
    """Split model.safetensors into two shards plus an index, as save_pretrained does for big models."""
    tensors = load_file(model_dir / "model.safetensors")
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file_name, part in halves.items():
        save_file({n: tensors[n] for n in part}, model_dir / file_name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file_name))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    (model_dir / "model.safetensors").unlink()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_sharded_checkpoint_loads_identically(tmp_path, checkpoint_factory, arch):
    single_dir = checkpoint_factory(arch=arch)
    sharded_dir = copy_checkpoint(single_dir, tmp_path / "sharded")
    shard(sharded_dir)
    single, sharded = load(single_dir), load(sharded_dir)
    single_state, sharded_state = single.state_dict(), sharded.state_dict()
    assert single_state.keys() == sharded_state.keys()
    for name, tensor in single_state.items():
        assert torch.equal(tensor, sharded_state[name]), name
    assert torch.equal(engine_last_logits(single, PROMPT), engine_last_logits(sharded, PROMPT))


def test_missing_shard_is_named(tmp_path, checkpoint_factory):
    model_dir = copy_checkpoint(checkpoint_factory(arch="llama"), tmp_path / "sharded")
    shard(model_dir)
    (model_dir / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="shard model-00002-of-00002.safetensors .* is missing"):
        load(model_dir)


def test_tied_and_untied_embeddings(checkpoint_factory):
    tied = load(checkpoint_factory(arch="qwen2"))  # no lm_head.weight in the file
    assert tied.lm_head.weight.data_ptr() == tied.embed_tokens.weight.data_ptr()
    untied_dir = checkpoint_factory(arch="llama")
    untied = load(untied_dir)
    file_tensors = load_file(untied_dir / "model.safetensors")
    assert torch.equal(untied.lm_head.weight, file_tensors["lm_head.weight"])
    assert not torch.equal(untied.lm_head.weight, untied.embed_tokens.weight)


def test_untied_checkpoint_without_lm_head_is_missing_a_tensor(llama_copy):
    rewrite_tensors(llama_copy, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\): lm_head\.weight"):
        load(llama_copy)


def test_the_unsupported_architecture_error_names_every_supported_one(llama_copy):
    """Generated from SUPPORTED_ARCHITECTURES (MoE included); its opening words are what workers'
    heartbeats carry and the API refuses jobs by (jobs/workers.py)."""
    from bulkinfer.engine.models.loader import SUPPORTED_ARCHITECTURES
    from bulkinfer.jobs.workers import UNSUPPORTED_ARCHITECTURE

    rewrite_config(llama_copy, lambda c: c.update(architectures=["DeepseekV3ForCausalLM"]))
    with pytest.raises(UnsupportedModelError) as error:
        load(llama_copy)
    message = str(error.value)
    assert message.startswith(f"{UNSUPPORTED_ARCHITECTURE} ['DeepseekV3ForCausalLM']")
    moe = {"Qwen3MoeForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM"}
    assert moe <= SUPPORTED_ARCHITECTURES.keys()
    assert all(name in message.split("supported: ")[1] for name in SUPPORTED_ARCHITECTURES)

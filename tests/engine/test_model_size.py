"""Parameters, active parameters and weight memory from a checkpoint's files (engine/model_size.py)."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from bulkinfer.engine.checkpoints import make_config, num_parameters
from bulkinfer.engine.model_size import describe_size, model_size


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3_moe", "mixtral", "qwen2_moe"])
def test_parameters_are_the_checkpoints_and_active_ones_count_top_k_experts(checkpoint_factory, arch):
    size = model_size(checkpoint_factory(arch=arch))
    config = make_config("tiny", arch)
    assert size.parameters == num_parameters("tiny", arch)  # tied embeddings once (qwen2)
    assert size.architecture == config.architectures[0]
    if arch in ("llama", "qwen2"):
        assert size.active_parameters == size.parameters and size.num_experts == 0
        return
    # Independently: one expert's three matrices, in every sparse layer, times the experts not run.
    width = config.intermediate_size if arch == "mixtral" else config.moe_intermediate_size
    sparse_layers = config.num_hidden_layers - len(getattr(config, "mlp_only_layers", None) or [])
    per_expert = 3 * config.hidden_size * width
    experts = config.num_local_experts if arch == "mixtral" else config.num_experts
    idle = experts - config.num_experts_per_tok
    assert size.active_parameters == size.parameters - sparse_layers * idle * per_expert
    assert (size.num_experts, size.experts_per_token) == (experts, config.num_experts_per_tok)


def test_weight_memory_per_dtype_and_tensor_parallel_size(checkpoint_factory):
    size = model_size(checkpoint_factory(arch="mixtral"))
    assert size.weight_bytes("float32") == 4 * size.parameters
    assert size.weight_bytes("bfloat16", 2) == size.parameters  # 2 bytes over 2 devices
    assert size.weight_bytes("bfloat16", 8) == -(-2 * size.parameters // 8)
    lines = describe_size(size, (1, 2))
    assert lines[0].startswith("MixtralForCausalLM: 6.23M parameters (2.10M active: 2 of 8 experts a token)")
    assert "TP=1" in lines[1] and "TP=2" in lines[1]
    assert lines[2].split() == ["float32", "23.8", "MiB", "11.9", "MiB"]
    assert "KV cache comes on top" in lines[-1]


def test_a_sharded_checkpoint_and_a_tied_copy_of_the_embedding(checkpoint_factory, tmp_path):
    source = checkpoint_factory(arch="qwen2")  # tied: no lm_head.weight in the file
    tensors = load_file(str(source / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()  # some exporters write it
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half],
              "model-00002-of-00002.safetensors": names[half:]}
    for file, members in shards.items():
        save_file({n: tensors[n] for n in members}, str(tmp_path / file))
    weight_map = {n: file for file, members in shards.items() for n in members}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    shutil.copy(source / "config.json", tmp_path / "config.json")
    assert model_size(tmp_path).parameters == num_parameters("tiny", "qwen2")


def test_a_quantized_checkpoint_counts_its_unpacked_parameters_and_the_memory_it_saves(checkpoint_factory,
                                                                                       tmp_path):
    from bulkinfer.benchmarks.quant_checkpoints import write_quantized_checkpoint

    source = checkpoint_factory()
    folder = write_quantized_checkpoint(source, tmp_path / "w4a16", bits=4, group_size=8)
    size, plain = model_size(folder), model_size(source)
    assert size.parameters == plain.parameters  # packed int32 words counted as the values they hold
    assert size.scheme is not None and "W4A16" in size.scheme
    # 4-bit values plus fp32 scales per 8 inputs (1 byte per weight in all): a third of bf16's memory
    # for the projections; the embedding and LM head stay bf16
    assert size.quantized_bytes == size.quantized_parameters // 2 + size.quantized_parameters // 8 * 4
    assert size.weight_bytes("bfloat16") < plain.weight_bytes("bfloat16")
    assert any(line.startswith("quantized: compressed-tensors W4A16") and "less than in bf16" in line
               for line in describe_size(size))

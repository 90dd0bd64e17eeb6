"""PEFT LoRA folders: what is read, what is refused (by name), and the engine's request interface."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch

from bulkinfer.engine import LLM, EngineConfig, LLMEngine, LoRAAdapterError, LoRARequest, SamplingParams
from bulkinfer.engine.lora import read_adapter_config
from tests.engine.lora_adapters import ALL_PROJECTIONS, ATTENTION_ONLY, make_adapter

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
PROMPT = list(range(20, 50))


@pytest.fixture(scope="module")
def base_dir(checkpoint_factory) -> Path:
    return checkpoint_factory(arch="llama")


@pytest.fixture(scope="module")
def adapter(base_dir) -> Path:
    return make_adapter(base_dir, seed=1)[0]


@pytest.fixture(scope="module")
def llm(base_dir) -> LLM:
    return LLM(model=str(base_dir), num_kv_blocks=64, dtype="float32", enable_lora=True, max_loras=2,
               max_lora_rank=8)


def edited_copy(adapter: Path, tmp_path: Path, **changes) -> Path:
    folder = tmp_path / "edited"
    shutil.copytree(adapter, folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    config.update(changes)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def test_peft_folder_is_read_with_its_rank_alpha_and_targets(adapter):
    config = read_adapter_config(adapter)
    assert (config.rank, config.lora_alpha, config.use_rslora) == (8, 16.0, False)
    assert config.scale == 2.0
    assert config.target_modules == tuple(sorted(ALL_PROJECTIONS))


def test_rslora_scales_by_the_square_root_of_the_rank(adapter, tmp_path):
    config = read_adapter_config(edited_copy(adapter, tmp_path, use_rslora=True))
    assert config.scale == pytest.approx(16.0 / math.sqrt(8))


@pytest.mark.parametrize(("changes", "message"), [
    ({"use_dora": True}, "DoRA"),
    ({"bias": "all"}, "bias='all'"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"peft_type": "IA3"}, "peft_type 'IA3'"),
    ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"),
    ({"target_modules": ["q_proj", "lm_head"]}, "['lm_head'] are not supported"),
    ({"r": 0}, "r must be a positive integer"),
])
def test_unsupported_settings_are_refused_by_name(adapter, tmp_path, changes, message):
    with pytest.raises(LoRAAdapterError, match=message.replace("[", r"\[").replace("(", r"\(")):
        read_adapter_config(edited_copy(adapter, tmp_path, **changes))


def test_missing_files_are_named(adapter, tmp_path):
    with pytest.raises(LoRAAdapterError, match="not a folder"):
        read_adapter_config(tmp_path / "nowhere")
    folder = edited_copy(adapter, tmp_path)
    (folder / "adapter_model.safetensors").unlink()
    with pytest.raises(LoRAAdapterError, match="adapter_model.safetensors is missing"):
        read_adapter_config(folder)
    (folder / "adapter_config.json").unlink()
    with pytest.raises(LoRAAdapterError, match="adapter_config.json is missing"):
        read_adapter_config(folder)


def test_output_names_its_adapter_and_base_rows_have_none(llm, adapter):
    base_output, lora_output = llm.generate([PROMPT, PROMPT], GREEDY,
                                            lora_request=[None, LoRARequest("one", 1, str(adapter))])
    assert base_output.lora_name is None and lora_output.lora_name == "one"
    assert base_output.error is None and lora_output.error is None
    assert base_output.token_ids != lora_output.token_ids  # the adapter changes what is generated


def test_a_rank_above_max_lora_rank_is_refused_at_add_request(llm, base_dir):
    big = make_adapter(base_dir, seed=2, rank=16, targets=ATTENTION_ONLY)[0]
    with pytest.raises(LoRAAdapterError, match="rank 16 exceeds max_lora_rank=8"):
        llm.engine.add_request("big", PROMPT, GREEDY, lora_request=LoRARequest("big", 7, str(big)))
    assert not llm.engine.has_unfinished_requests()


def test_an_adapter_of_another_base_model_is_refused_naming_the_shapes(llm, adapter, tmp_path):
    from safetensors.torch import load_file, save_file

    other = edited_copy(adapter, tmp_path)
    tensors = load_file(str(other / "adapter_model.safetensors"))
    name = "base_model.model.model.layers.2.self_attn.v_proj.lora_A.weight"
    tensors[name] = torch.randn(8, 96)  # a base model with hidden size 96, not 128
    save_file(tensors, str(other / "adapter_model.safetensors"))
    with pytest.raises(LoRAAdapterError, match=r"'other'.*layers.2.self_attn.v_proj has lora_A \(8, 96\)"):
        llm.generate([PROMPT], GREEDY, lora_request=LoRARequest("other", 8, str(other)))


def test_one_lora_int_id_cannot_name_two_adapters(llm, adapter, base_dir):
    second = make_adapter(base_dir, seed=4, targets=ATTENTION_ONLY)[0]
    llm.generate([PROMPT], GREEDY, lora_request=LoRARequest("first", 3, str(adapter)))
    with pytest.raises(LoRAAdapterError, match="lora_int_id 3 already names adapter 'first'"):
        llm.generate([PROMPT], GREEDY, lora_request=LoRARequest("second", 3, str(second)))


def test_a_bad_adapter_in_a_batch_queues_no_prompt(llm, adapter, tmp_path):
    broken = edited_copy(adapter, tmp_path, use_dora=True)
    with pytest.raises(LoRAAdapterError, match="DoRA"):
        llm.generate([PROMPT, PROMPT], GREEDY,
                     lora_request=[LoRARequest("one", 1, str(adapter)), LoRARequest("bad", 9, str(broken))])
    assert not llm.engine.has_unfinished_requests()


def test_an_engine_without_enable_lora_refuses_lora_requests(base_dir, adapter):
    engine = LLMEngine(EngineConfig(model=str(base_dir), num_kv_blocks=16, dtype="float32"))
    with pytest.raises(ValueError, match="without enable_lora"):
        engine.add_request("r", PROMPT, GREEDY, lora_request=LoRARequest("one", 1, str(adapter)))


@pytest.mark.parametrize(("field", "value", "message"), [
    ("max_loras", 0, "max_loras must be >= 1"),
    ("max_lora_rank", 0, "max_lora_rank must be >= 1"),
    ("max_cpu_loras", 1, r"max_cpu_loras \(1\) must be >= max_loras \(2\)"),
    ("tensor_parallel_size", 2, "enable_lora cannot be used with tensor_parallel_size > 1"),
])
def test_lora_settings_are_validated(field, value, message):
    config = EngineConfig(model="m", enable_lora=True, max_loras=2)
    setattr(config, field, value)
    with pytest.raises(ValueError, match=message):
        config.validate()


@pytest.mark.parametrize(("changes", "message"), [
    ({"use_rslora": "false"}, 'use_rslora must be true or false, got the string "false"'),
    ({"use_dora": "false"}, 'use_dora must be true or false, got the string "false"'),
    ({"r": "8"}, 'r must be a positive integer, got the string "8"'),
    ({"r": 8.0}, "r must be a positive integer, got the number 8.0"),
    ({"lora_alpha": "16"}, 'lora_alpha must be a number, got the string "16"'),
    ({"lora_alpha": True}, "lora_alpha must be a number, got the boolean true"),
    ({"target_modules": 5}, "target_modules must be a list of names or a string, got the number 5"),
    ({"target_modules": ["q_proj", 5]}, "target_modules must be a list of names or a string"),
    ({"modules_to_save": "lm_head"}, "modules_to_save must be a list of names"),
    ({"bias": False}, "bias must be a string, got the boolean false"),
    ({"peft_type": 1}, "peft_type must be a string, got the number 1"),
    ({"rank_pattern": ["q_proj"]}, "rank_pattern must be an object"),
    ({"alora_invocation_tokens": [1, 2]}, "alora_invocation_tokens (a LoRA variant) is not supported"),
])
def test_config_fields_must_have_their_json_types(adapter, tmp_path, changes, message):
    # Truthiness would read "false" as true: rsLoRA's scale, silently wrong.
    with pytest.raises(LoRAAdapterError, match=re.escape(message)):
        read_adapter_config(edited_copy(adapter, tmp_path, **changes))


def test_null_fields_take_peft_defaults(adapter, tmp_path):
    config = read_adapter_config(edited_copy(adapter, tmp_path, use_rslora=None, bias=None, use_dora=None))
    assert (config.use_rslora, config.scale) == (False, 2.0)


V_PROJ = "base_model.model.model.layers.2.self_attn.v_proj.lora_"


def with_tensors(adapter: Path, tmp_path: Path, change) -> Path:
    """A copy of the adapter whose v_proj tensors {"A": ..., "B": ...} are replaced by change(them)."""
    from safetensors.torch import load_file, save_file

    folder = edited_copy(adapter, tmp_path)
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    halves = {half: tensors[V_PROJ + half + ".weight"] for half in "AB"}
    for half, tensor in change(halves).items():
        tensors[V_PROJ + half + ".weight"] = tensor
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


@pytest.mark.parametrize(("change", "message"), [
    (lambda t: {"A": torch.tensor(1.0)}, r"lora_A \(\) and lora_B \(.*\); each must be a matrix"),
    (lambda t: {"A": t["A"][0]}, r"lora_A \(128,\) and lora_B \(.*\); each must be a matrix"),
    (lambda t: {"B": t["B"][None]}, r"lora_B \(1, .*\); each must be a matrix"),
    (lambda t: {"A": t["A"].to(torch.int32)}, "is torch.int32; LoRA weights must be float16"),
    (lambda t: {"A": t["A"].to(torch.float8_e4m3fn)}, "is torch.float8_e4m3fn"),
    (lambda t: {"A": t["A"][:4].contiguous(), "B": t["B"][:, :4].contiguous()},
     "v_proj has rank 4, but r is 8"),
], ids=["0-dim", "1-dim", "3-dim", "int32", "float8", "rank-not-r"])
def test_malformed_tensors_are_refused_not_raised(llm, adapter, tmp_path, change, message):
    broken = with_tensors(adapter, tmp_path, change)
    with pytest.raises(LoRAAdapterError, match=r"'broken'.*" + message):
        llm.engine.add_request("broken", PROMPT, GREEDY, lora_request=LoRARequest("broken", 10, str(broken)))
    assert not llm.engine.has_unfinished_requests()

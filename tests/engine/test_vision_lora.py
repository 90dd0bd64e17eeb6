"""LoRA adapters on a vision-language model: PEFT adapters trained on the language model of
transformers' Idefics3 run on image rows with the merged model's greedy tokens (transformers, fp32);
an adapter that also targets the vision tower is refused naming it, since the engine applies
adapters to the decoder's layers only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bulkinfer.engine import LoRAAdapterError, LoRARequest
from bulkinfer.engine.config import EngineConfig
from bulkinfer.engine.llm_engine import LLMEngine
from bulkinfer.engine.sampling_params import SamplingParams
from bulkinfer.engine.vision_checkpoints import cached_vision_checkpoint
from tests.engine.lora_adapters import cached_adapter, save_adapter_and_merged
from tests.support.vision_reference import chat_text, greedy_outputs, hf_greedy_check, picture

CACHE = Path(__file__).resolve().parents[2] / ".cache" / "lora_adapters"
TEXT_MODEL_ONLY = r".*text_model.*\.(q_proj|v_proj|o_proj|gate_proj|down_proj)"
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def vlm_adapter(base_dir: str, targets: str | list[str], seed: int = 0) -> tuple[Path, Path]:
    """(adapter, merged checkpoint) trained-shaped by PEFT on transformers' Idefics3, cached."""

    def build(adapter_dir: Path, merged_dir: Path) -> None:
        from peft import LoraConfig, get_peft_model
        from transformers import Idefics3ForConditionalGeneration

        torch.manual_seed(seed)
        base = Idefics3ForConditionalGeneration.from_pretrained(base_dir, dtype=torch.float32)
        model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=targets,
                                                init_lora_weights=False, lora_dropout=0.0))
        # The tokenizer, chat template and image processor beside the merged weights.
        files = [file.name for file in Path(base_dir).iterdir() if file.is_file()]
        save_adapter_and_merged(model, base_dir, adapter_dir, merged_dir, files)

    return cached_adapter([base_dir, targets, seed, "idefics3"], build)


@pytest.fixture(scope="module")
def vlm() -> str:
    return str(cached_vision_checkpoint("tiny"))


def test_a_language_model_adapter_gives_the_merged_models_tokens_on_image_rows(vlm):
    adapter, merged = vlm_adapter(vlm, TEXT_MODEL_ONLY)
    llm = LLMEngine(EngineConfig(model=vlm, dtype="float32", num_kv_blocks=256, enable_lora=True,
                                 max_lora_rank=8))
    requests = {"photo": (chat_text(vlm, "What is this?"), [picture(0, 50, 90)]),
                "two": (chat_text(vlm, "Compare them.", 2), [picture(1, 30, 30), picture(2, 120, 40)]),
                "text": ("Just some text, no picture at all.", [])}
    tuned = greedy_outputs(llm, requests, GREEDY, LoRARequest("captions", 1, str(adapter)))
    base = greedy_outputs(llm, {f"base-{key}": value for key, value in requests.items()}, GREEDY)
    for request_id, (text, images) in requests.items():
        assert hf_greedy_check(str(merged), text, images, tuned[request_id]) == tuned[request_id], request_id
    assert any(tuned[key] != base[f"base-{key}"] for key in requests), "the adapter changes the answers"


def test_an_adapter_on_the_vision_tower_is_refused_naming_it(vlm):
    adapter, _ = vlm_adapter(vlm, ["q_proj", "v_proj"])  # PEFT puts these in SigLIP's layers too
    llm = LLMEngine(EngineConfig(model=vlm, dtype="float32", num_kv_blocks=64, enable_lora=True,
                                 max_lora_rank=8))
    with pytest.raises(LoRAAdapterError, match="LoRA on the vision tower or its connector"):
        llm.add_request("r", chat_text(vlm, "What is this?"), GREEDY, images=[picture(0, 50, 90)],
                        lora_request=LoRARequest("everywhere", 1, str(adapter)))

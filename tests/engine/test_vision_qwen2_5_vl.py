"""Qwen2.5-VL in the engine, against transformers' Qwen2.5-VL on a random checkpoint (windowed ViT,
2-D vision rotary, patch merger, M-RoPE in the decoder): fp32 greedy tokens equal transformers' for
one and several images, mixed image and text rows in one step, a shared image's prefix hit, images
split over prefill chunks, preemption; bf16 no worse than transformers' own bf16."""

from __future__ import annotations

import pytest
import torch

from bulkinfer.engine.config import EngineConfig
from bulkinfer.engine.llm_engine import LLMEngine
from bulkinfer.engine.qwen_vl_checkpoint import cached_qwen_vl_checkpoint
from bulkinfer.engine.sampling_params import SamplingParams
from tests.engine.hf_reference import assert_no_worse_than_reference
from tests.support.vision_reference import PrecomputedLogits, hf_qwen_logits, picture, qwen_chat_text

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PICTURES = [picture(0, 90, 120), picture(1, 60, 60), picture(2, 120, 40)]


@pytest.fixture(scope="module")
def qwen() -> str:
    return str(cached_qwen_vl_checkpoint())


def engine(model: str, dtype: str = "float32", **options) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, dtype=dtype, **{"num_kv_blocks": 256, **options}))


def run(llm: LLMEngine, requests: dict[str, tuple], params: SamplingParams = GREEDY) -> dict[str, tuple]:
    """requests: id -> (prompt text, images); (expanded prompt ids, greedy tokens) by id."""
    prompts = {}
    for request_id, (text, images) in requests.items():
        prompt = llm.process_prompt(text, images) if images else llm.tokenizer.encode(text)
        prompts[request_id] = prompt.token_ids if images else prompt
        llm.add_request(request_id, prompt, params)
    outputs = {}
    while llm.has_unfinished_requests():
        for output in llm.step():
            if output.finished:
                assert output.outputs[0].finish_reason != "error", output.outputs[0]
                outputs[output.request_id] = (prompts[output.request_id], output.outputs[0].token_ids)
    return outputs


def assert_transformers_greedy(qwen: str, requests: dict[str, tuple], outputs: dict[str, tuple]) -> None:
    for request_id, (_, images) in requests.items():
        prompt, tokens = outputs[request_id]
        assert hf_qwen_logits(qwen, prompt, images, tokens).argmax(-1).tolist() == tokens, request_id


def test_fp32_greedy_matches_transformers(qwen):
    requests = {"wide": (qwen_chat_text(qwen, "What is this?"), [PICTURES[0]]),
                "tall": (qwen_chat_text(qwen, "What is this?"), [PICTURES[2]]),
                "two": (qwen_chat_text(qwen, "Compare them.", 2), PICTURES[:2]),
                "text": (qwen_chat_text(qwen, "No picture here.", 0), [])}
    outputs = run(engine(qwen), requests)
    assert_transformers_greedy(qwen, requests, outputs)
    assert outputs["wide"][1] != outputs["tall"][1]


def test_a_shared_image_hits_the_prefix_with_the_same_positions(qwen):
    llm = engine(qwen)
    text = qwen_chat_text(qwen, "What is this?")
    first = run(llm, {"a": (text, [PICTURES[0]])})
    again = run(llm, {"b": (text, [PICTURES[0]])})
    assert again["b"] == first["a"]
    assert llm.get_metrics()["prefix_cache_hit_rate"] > 0


@pytest.mark.parametrize("options", [
    {"max_num_batched_tokens": 16, "enable_prefix_caching": False},  # images and positions over chunks
    {"num_kv_blocks": 10, "max_num_batched_tokens": 24, "kv_growth_reserve_tokens": 0},  # preempted
])
def test_chunked_prefill_and_preemption_keep_the_tokens(qwen, options):
    requests = {f"r{i}": (qwen_chat_text(qwen, f"Question {i}?"), [PICTURES[i % 3]]) for i in range(4)}
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    reference = run(engine(qwen), requests, params)
    llm = engine(qwen, **options)
    assert run(llm, requests, params) == reference
    if "num_kv_blocks" in options:
        assert llm.scheduler.num_preemptions > 0


def test_bf16_is_no_worse_than_transformers_bf16(qwen):
    """Judged over every row's tokens together: the random model's top-2 gaps are often under 0.1,
    where bf16 rounding alone flips a token (transformers' own bf16 does too)."""
    requests = {f"r{i}": (qwen_chat_text(qwen, "What is this?"), [image]) for i, image in enumerate(PICTURES)}
    outputs = run(engine(qwen, dtype="bfloat16"), requests,
                  SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    low, exact = PrecomputedLogits(), PrecomputedLogits()
    for request_id, (_, images) in requests.items():
        prompt, tokens = outputs[request_id]
        low.add(prompt, tokens, hf_qwen_logits(qwen, prompt, images, tokens, torch.bfloat16))
        exact.add(prompt, tokens, hf_qwen_logits(qwen, prompt, images, tokens))
    assert_no_worse_than_reference(list(outputs.values()), low, exact, torch.bfloat16, min_agreement=0.75,
                                   deficit_factor=1.5)


def test_published_and_transformers_5_layouts_both_load():
    """Qwen/Qwen2.5-VL-* configs keep the decoder's fields on top with `rope_scaling: mrope`, and their
    tensors are `visual.*` / `model.*`; transformers 5 writes `text_config` and `model.visual.*` /
    `model.language_model.*`. Both read the same."""
    from bulkinfer.engine.models.qwen2_5_vl import Qwen25VLConfig, Qwen25VLForConditionalGeneration

    vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
              "fullatt_block_indexes": [1], "hidden_act": "silu", "window_size": 112}
    published = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 600,
                 "rope_theta": 1000000.0, "image_token_id": 590, "vision_config": vision,
                 "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}}
    config = Qwen25VLConfig.from_hf_dict("Qwen2_5_VLForConditionalGeneration", published)
    assert config.mrope_section == (2, 3, 3) and config.qkv_bias and config.rope_theta == 1000000.0
    assert config.vision is not None and config.vision.fullatt_block_indexes == (1,)
    one = torch.zeros(1)
    renamed = Qwen25VLForConditionalGeneration.normalize_tensor_names(
        {"model.visual.blocks.0.norm1.weight": one, "lm_head.weight": one, "visual.merger.ln_q.weight": one,
         "model.language_model.layers.0.input_layernorm.weight": one})
    assert set(renamed) == {"visual.blocks.0.norm1.weight", "model.layers.0.input_layernorm.weight",
                            "lm_head.weight", "visual.merger.ln_q.weight"}

"""Idefics3 / SmolVLM in the engine, against transformers' Idefics3 on a random checkpoint (fp32:
the same greedy tokens; bf16: no worse than transformers' own bf16), through single and several
images, mixed image and text rows in one step, prefix hits on a shared image, chunked prefill and
preemption; and the prompt span against transformers' processor."""

from __future__ import annotations

import pytest
import torch

from bulkinfer.engine.config import EngineConfig
from bulkinfer.engine.errors import ErrorKind
from bulkinfer.engine.llm_engine import LLMEngine
from bulkinfer.engine.sampling_params import SamplingParams
from bulkinfer.engine.vision_checkpoints import cached_vision_checkpoint
from tests.engine.hf_reference import assert_no_worse_than_reference
from tests.support.vision_reference import (
    PrecomputedLogits,
    chat_text,
    greedy_outputs,
    hf_greedy_check,
    hf_inputs,
    hf_logits,
    picture,
)

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PICTURES = [picture(0, 50, 90), picture(1, 30, 30), picture(2, 120, 40)]


@pytest.fixture(scope="module")
def vlm() -> str:
    return str(cached_vision_checkpoint("tiny"))


def engine(model: str, dtype: str = "float32", **options) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, dtype=dtype, **{"num_kv_blocks": 256, **options}))


def run(llm: LLMEngine, requests: dict[str, tuple], params: SamplingParams = GREEDY) -> dict[str, list[int]]:
    """requests: id -> (prompt, images); greedy tokens by id."""
    return greedy_outputs(llm, requests, params)


def test_prompt_span_is_transformers_processors(vlm):
    llm = engine(vlm)
    for images in ([PICTURES[0]], [PICTURES[1]], PICTURES):
        text = chat_text(vlm, "Describe.", len(images))
        expected = hf_inputs(vlm, text, images)["input_ids"][0].tolist()
        assert llm.process_prompt(text, images).token_ids == expected
    text = chat_text(vlm, "Describe.")
    low = llm.process_prompt(text, [PICTURES[0]], details=["low"])
    expected = hf_inputs(vlm, text, [PICTURES[0]], do_image_splitting=False)["input_ids"][0].tolist()
    assert low.token_ids == expected
    assert low.items[0].digest != llm.process_prompt(text, [PICTURES[0]]).items[0].digest


def test_fp32_greedy_matches_transformers_for_image_mixed_and_text_rows(vlm):
    llm = engine(vlm)
    requests = {
        "one": (chat_text(vlm, "What is this?"), [PICTURES[0]]),
        "square": (chat_text(vlm, "What is this?"), [PICTURES[1]]),
        "three": (chat_text(vlm, "Compare them.", 3), PICTURES),
        "text": ("Just some text, no picture at all.", []),
    }
    outputs = run(llm, requests)
    for request_id, (text, images) in requests.items():
        assert hf_greedy_check(vlm, text, images, outputs[request_id]) == outputs[request_id], request_id
    assert outputs["one"] != outputs["square"], "the image changes the answer"


def test_shared_image_hits_the_prefix_and_encoder_caches_different_images_do_not(vlm):
    llm = engine(vlm)
    text = chat_text(vlm, "What is this?")
    first = run(llm, {"a": (text, [PICTURES[0]])})["a"]
    span = llm.process_prompt(text, [PICTURES[0]]).items[0]
    llm.add_request("b", text, GREEDY, images=[PICTURES[0]])
    llm.add_request("c", text, GREEDY, images=[PICTURES[2]])
    llm.step()
    by_id = {request.request_id: request for request in llm.scheduler.running}
    assert by_id["b"].num_cached_tokens >= (span.end // 16) * 16 > span.offset
    assert by_id["c"].num_cached_tokens <= span.offset  # only the text before the image
    outputs = {}
    while llm.has_unfinished_requests():
        outputs.update({o.request_id: o.outputs[0].token_ids for o in llm.step() if o.finished})
    assert outputs["b"] == first
    assert outputs["c"] == hf_greedy_check(vlm, text, [PICTURES[2]], outputs["c"])


def test_encoder_runs_once_per_image_across_rows(vlm):
    llm = engine(vlm, enable_prefix_caching=False)
    text = chat_text(vlm, "Tags?")
    outputs = run(llm, {f"r{i}": (text, [PICTURES[0]]) for i in range(3)})
    assert len(set(map(tuple, outputs.values()))) == 1
    cache = llm.images.cache
    assert len(cache) == 1 and cache.misses == 1 and cache.hits >= 2


@pytest.mark.parametrize("options", [
    {"max_num_batched_tokens": 16, "enable_prefix_caching": False},  # images split over chunks
    # preempted mid-prompt and after it, and recomputed
    {"num_kv_blocks": 12, "max_num_batched_tokens": 24, "kv_growth_reserve_tokens": 0},
])
def test_chunked_prefill_and_preemption_keep_the_tokens(vlm, options):
    requests = {f"r{i}": (chat_text(vlm, f"Question {i}?"), [PICTURES[i % 3]]) for i in range(4)}
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    reference = run(engine(vlm), requests, params)
    llm = engine(vlm, **options)
    assert run(llm, requests, params) == reference
    if "num_kv_blocks" in options:
        assert llm.scheduler.num_preemptions > 0


def test_bf16_is_no_worse_than_transformers_bf16(vlm):
    """Judged over every row's tokens together (a random model's top-2 gaps are often tiny)."""
    llm = engine(vlm, dtype="bfloat16")
    requests = {f"r{i}": (chat_text(vlm, "What is this?"), [image]) for i, image in enumerate(PICTURES)}
    outputs = run(llm, requests, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    low, exact, pairs = PrecomputedLogits(), PrecomputedLogits(), []
    for request_id, (text, images) in requests.items():
        tokens = outputs[request_id]
        prompt = hf_inputs(vlm, text, images)["input_ids"][0].tolist()
        low.add(prompt, tokens, hf_logits(vlm, text, images, tokens, torch.bfloat16))
        exact.add(prompt, tokens, hf_logits(vlm, text, images, tokens))
        pairs.append((prompt, tokens))
    assert_no_worse_than_reference(pairs, low, exact, torch.bfloat16, min_agreement=0.75, deficit_factor=1.5)


def test_bad_images_fail_their_request_alone(vlm, tiny_checkpoint):
    llm = engine(vlm)
    text = chat_text(vlm, "What is this?")
    llm.add_request("corrupt", text, GREEDY, images=[b"not an image"])
    llm.add_request("count", text, GREEDY, images=[PICTURES[0], PICTURES[1]])
    llm.add_request("good", text, GREEDY, images=[PICTURES[0]])
    done = {}
    while llm.has_unfinished_requests() or not done:
        done.update({o.request_id: o for o in llm.step() if o.finished})
    for bad, words in (("corrupt", "not an image"), ("count", "1 image placeholder(s)")):
        assert done[bad].outputs[0].finish_reason == "error"
        assert done[bad].error_kind == ErrorKind.INVALID_IMAGE and words in done[bad].error
    assert done["good"].outputs[0].finish_reason == "length"
    text_only = engine(str(tiny_checkpoint))
    text_only.add_request("x", "hello", GREEDY, images=[PICTURES[0]])
    (output,) = text_only.step()
    assert output.error_kind == ErrorKind.INVALID_IMAGE and "takes no images" in output.error


def test_offline_llm_generate_and_chat_take_images(vlm, tmp_path):
    from bulkinfer.engine.llm import LLM

    llm = LLM(vlm, dtype="float32", num_kv_blocks=128)
    text = chat_text(vlm, "What is this?")
    expected = run(engine(vlm), {"x": (text, [PICTURES[0]])})["x"]
    [generated] = llm.generate({"prompt": text, "multi_modal_data": {"image": PICTURES[0]}}, GREEDY)
    assert generated.outputs[0].token_ids == expected
    path = tmp_path / "picture.png"
    PICTURES[0].save(path)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": str(path)}},
                                             {"type": "text", "text": "What is this?"}]}]
    [chatted] = llm.chat(messages, GREEDY)
    assert chatted.outputs[0].token_ids == expected  # a PNG keeps the pixels: the same image


def test_encoder_work_counts_in_the_step_budget(vlm):
    """An uncached image costs its encoder rows in the token budget: a second row whose image does not
    fit after the first row's prompt and image stops before its image; the same image is charged once."""
    text = chat_text(vlm, "What is this?")
    for second in (PICTURES[2], PICTURES[0]):
        llm = engine(vlm, max_num_batched_tokens=100, enable_prefix_caching=False)
        first, other = llm.process_prompt(text, [PICTURES[0]]), llm.process_prompt(text, [second])
        llm.add_request("a", first, GREEDY)
        llm.add_request("b", other, GREEDY)
        chunks = {chunk.request.request_id: chunk.num_new_tokens for chunk in llm.scheduler.schedule().chunks}
        left = 100 - len(first.token_ids) - first.items[0].num_embeds
        assert chunks["a"] == len(first.token_ids)
        if second is PICTURES[0]:
            assert chunks["b"] == left  # its image is a's: charged once
        else:
            assert left < len(other.token_ids) + other.items[0].num_embeds
            assert chunks["b"] == other.items[0].offset  # stops before an image that does not fit

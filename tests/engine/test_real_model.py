"""The engine on a real instruct model (SmolLM2-135M-Instruct, imported from its GGUF): real answers,
its chat template and `<|im_end|>`, JSON-schema extraction, the same answers in fp32 and bf16, and
greedy tokens equal to transformers' on the same weights (fp32 exact, bf16 within rounding noise)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from bulkinfer.engine import LLM, SamplingParams
from bulkinfer.engine.chat import chat_token_ids
from bulkinfer.engine.cpu_features import native_bf16_products
from bulkinfer.jobs.demo_data import EXTRACTION_INSTRUCTIONS, EXTRACTION_SCHEMA, ORDERS
from tests.engine.hf_reference import assert_greedy_within_noise, assert_same_greedy, hf_greedy

IM_END = 2  # <|im_end|>: the model's EOS, and the end of each chat turn
# "What is the capital of France?" alone opens with "The" only 0.25 nats (two bf16 logit steps) above
# "L'": in bf16 a one-ulp change anywhere in the forward (batching, kernel order) flips it, as it
# did between two correct attention kernels. "Answer in one sentence." leaves a margin of >= 0.85
# for every token of the answer in both dtypes (measured), so these tests check the model, not a tie.
FRANCE = "What is the capital of France? Answer in one sentence."
QUESTIONS = {FRANCE: "Paris", "What is the capital of Japan?": "Tokyo",
             "Name three primary colors.": "Red"}
DTYPES = ["float32", "bfloat16"]
# bf16 is emulated (tens of times slower) on CPUs without native bf16: fewer rows there, same checks.
NATIVE_BF16 = native_bf16_products()
TESTED_ORDERS = ORDERS if NATIVE_BF16 else ORDERS[:8]


@pytest.fixture(scope="module")
def engines(real_model: Path) -> dict[str, LLM]:
    """One engine per dtype for the whole module (each load is seconds)."""
    return {dtype: LLM(str(real_model), dtype=dtype) for dtype in DTYPES}


@pytest.fixture(params=DTYPES)
def llm(request, engines: dict[str, LLM]) -> LLM:
    return engines[request.param]


@pytest.fixture(scope="module")
def answers(engines: dict[str, LLM]) -> dict[str, dict[str, object]]:
    """Per dtype: each question's answer text, and each order's extraction (parsed JSON)."""
    results = {}
    for dtype, engine in engines.items():
        questions = engine.chat([[{"role": "user", "content": q}] for q in QUESTIONS], _greedy(48))
        orders = engine.chat([_order_chat(text) for text, *_ in TESTED_ORDERS],
                             _greedy(64, json_schema=EXTRACTION_SCHEMA))
        results[dtype] = {"questions": [out.outputs[0].text for out in questions],
                          "orders": [json.loads(out.outputs[0].text) for out in orders]}
    return results


def _greedy(max_tokens: int, **options: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **options)


def _order_chat(text: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": EXTRACTION_INSTRUCTIONS}, {"role": "user", "content": text}]


def test_the_capital_of_france_is_paris_and_im_end_ends_the_answer(llm: LLM) -> None:
    [output] = llm.chat([{"role": "user", "content": FRANCE}], _greedy(48))
    completion = output.outputs[0]
    assert "Paris" in completion.text
    assert completion.finish_reason == "stop" and completion.token_ids[-1] == IM_END
    assert "<|im_end|>" not in completion.text and "<|im_start|>" not in completion.text
    assert len(completion.token_ids) < 48


def test_prompts_render_with_the_models_own_chat_template(llm: LLM) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    ours = chat_token_ids(llm.tokenizer, messages)
    theirs = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    theirs = theirs["input_ids"] if isinstance(theirs, dict) or hasattr(theirs, "keys") else theirs
    assert ours == list(theirs)
    text = llm.tokenizer.decode(ours)
    # SmolLM2's template adds its default system turn, then the user's, then opens the assistant's.
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("dtype", DTYPES)
def test_json_schema_extraction_is_valid_json_with_the_right_values_in_most_rows(answers, dtype) -> None:
    extracted = answers[dtype]["orders"]
    assert len(extracted) == len(TESTED_ORDERS)
    right = 0
    for got, (_text, name, city, quantity) in zip(extracted, TESTED_ORDERS, strict=True):
        assert set(got) == {"name", "city", "quantity", "product"}
        right += (got["name"], got["city"], got["quantity"]) == (name, city, quantity)
    needed = math.ceil(0.7 * len(TESTED_ORDERS))  # measured: 14/16 (7/8 of the first 8) in both dtypes
    assert right >= needed, f"{dtype}: name, city and quantity right in only {right}/{len(TESTED_ORDERS)}"


def test_fp32_and_bf16_give_the_same_answers(answers) -> None:
    for dtype in DTYPES:
        for text, key in zip(answers[dtype]["questions"], QUESTIONS.values(), strict=True):
            assert key in text, f"{dtype}: {text!r} lacks {key!r}"
    fields = ("name", "city", "quantity")
    same = sum(all(a[f] == b[f] for f in fields)
               for a, b in zip(answers["float32"]["orders"], answers["bfloat16"]["orders"], strict=True))
    count = len(TESTED_ORDERS)
    assert same >= count - 2, f"fp32 and bf16 extract the same fields in only {same}/{count}"


def test_greedy_tokens_match_transformers_on_the_real_model(llm: LLM, real_model: Path) -> None:
    """A shared system prompt (prefix-cache hits, shared-prefix decode) over several turns."""
    few = not NATIVE_BF16 and llm.dtype_choice.dtype == "bfloat16"
    max_tokens = 16 if few else 32
    prompts = [chat_token_ids(llm.tokenizer, _order_chat(text)) for text, *_ in ORDERS[: 2 if few else 4]]
    prompts += [chat_token_ids(llm.tokenizer, [{"role": "user", "content": q}])
                for q in list(QUESTIONS)[: 1 if few else 3]]
    hits_before = llm.engine.get_metrics()["prefix_cache_hits"]
    outputs = llm.generate(prompts, _greedy(max_tokens))
    assert llm.engine.get_metrics()["prefix_cache_hits"] > hits_before  # the system prompt, shared
    dtype = llm.dtype_choice.dtype
    if dtype == "float32":
        for prompt, output in zip(prompts, outputs, strict=True):
            reference = hf_greedy(real_model, prompt, max_tokens)
            assert_same_greedy(output.token_ids, reference, prompt, real_model, llm.engine.model)
    else:
        pairs = [(prompt, output.token_ids) for prompt, output in zip(prompts, outputs, strict=True)]
        assert_greedy_within_noise(pairs, real_model, llm.engine.model, getattr(torch, dtype))


# The question without "Answer in one sentence.": in bf16 "The" leads "L" by less than a bf16 logit
# step, so it answers Paris only with fp32 logits, and the same way in any batch only if the row's
# bits do not depend on its neighbours (issue 45).
PLAIN_FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def test_the_plain_france_question_in_bf16_answers_paris_the_same_to_the_bit_among_63_rows(
        engines: dict[str, LLM]) -> None:
    llm = engines["bfloat16"]
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=2)
    [alone] = llm.chat(PLAIN_FRANCE, params)
    assert "Paris" in alone.outputs[0].text
    # 63 other questions under the same chat template (a shared prefix), of other lengths.
    others = [[{"role": "user", "content": f"What is {a} plus {a * 7 % 50}?" + " Explain." * (a % 5)}]
              for a in range(63)]
    crowd = llm.chat(others[:40] + [PLAIN_FRANCE] + others[40:], params)
    ours = crowd[40].outputs[0]
    assert ours.token_ids == alone.outputs[0].token_ids
    assert ours.logprobs == alone.outputs[0].logprobs  # every logprob to the last bit

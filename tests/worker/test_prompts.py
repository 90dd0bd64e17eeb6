"""Rows to engine requests: sampling knobs mapped or refused by name, prompts rendered like the engine."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from engine import SamplingParams
from jobs.formats.rows import Row, RowErrorCode
from jobs.sampling import SamplingParams as JobSampling
from worker.prompts import PromptRenderer, RowRejected, engine_error_code, engine_sampling


def row(prompt: str | None = None, messages: list | None = None) -> Row:
    return Row(0, "r0", prompt, messages, JobSampling(), None)


def test_supported_knobs_map_one_to_one_and_unset_ones_keep_the_engine_default() -> None:
    job = JobSampling(temperature=0.3, top_p=0.9, top_k=20, seed=7, max_tokens=12, stop_token_ids=[5],
                      ignore_eos=True)
    assert engine_sampling(job) == SamplingParams(temperature=0.3, top_p=0.9, top_k=20, seed=7, max_tokens=12,
                                                  stop_token_ids=[5], ignore_eos=True)
    assert engine_sampling(JobSampling()) == SamplingParams()


@pytest.mark.parametrize(("settings", "named"), [
    ({"stop": ["\n"]}, "stop strings"), ({"stop": "END"}, "stop strings"), ({"logprobs": 0}, "logprobs"),
    ({"presence_penalty": 0.1}, "presence_penalty=0.1"), ({"frequency_penalty": -1.0}, "frequency_penalty"),
    ({"repetition_penalty": 1.2}, "repetition_penalty=1.2"), ({"min_p": 0.05}, "min_p=0.05"),
    ({"min_tokens": 3}, "min_tokens=3"),
])
def test_unsupported_knobs_are_refused_by_name(settings: dict, named: str) -> None:
    with pytest.raises(RowRejected, match=named) as rejected:
        engine_sampling(JobSampling(**settings))
    assert rejected.value.code == RowErrorCode.INVALID_SAMPLING


def test_knobs_at_their_neutral_value_ask_for_nothing_and_are_accepted() -> None:
    neutral = JobSampling(stop=[], presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0,
                          min_p=0.0, min_tokens=0, max_tokens=3)
    assert engine_sampling(neutral) == SamplingParams(max_tokens=3)


def test_prompts_are_encoded_as_the_engine_encodes_text_and_chat_goes_through_the_template(
        tiny_checkpoint: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    renderer = PromptRenderer(tokenizer)
    assert renderer.token_ids(row(prompt="def main():")) == tokenizer.encode("def main():")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    rendered = tokenizer.decode(renderer.token_ids(row(messages=messages)))
    assert rendered == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n" \
                       "<|im_start|>assistant\n"


def test_chat_without_a_template_or_with_content_it_cannot_render_is_a_row_error(
        tiny_checkpoint: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    with pytest.raises(RowRejected, match="chat template rejected"):
        PromptRenderer(tokenizer).token_ids(row(messages=parts))
    tokenizer.chat_template = None
    with pytest.raises(RowRejected, match="no chat template"):
        PromptRenderer(tokenizer).token_ids(row(messages=[{"role": "user", "content": "hi"}]))


def test_engine_rejections_get_row_error_codes() -> None:
    too_long = "prompt has 300 tokens; with at least one generated token that exceeds max_model_len=256"
    assert engine_error_code(too_long) == RowErrorCode.PROMPT_TOO_LONG
    assert engine_error_code("prompt has 9000 tokens but the KV cache holds only 4096 tokens in all") \
        == RowErrorCode.PROMPT_TOO_LONG
    assert engine_error_code("prompt is empty") == RowErrorCode.INVALID_ROW
    assert engine_error_code("invalid sampling params: top_p must be in (0, 1]") == RowErrorCode.ENGINE_ERROR

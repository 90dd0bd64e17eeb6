"""Rows to engine requests: sampling knobs mapped or refused by name, prompts rendered like the engine."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from bulkinfer.engine import ErrorKind, SamplingParams
from bulkinfer.jobs.formats.rows import Row, RowBuilder, RowErrorCode
from bulkinfer.jobs.output_tokens import DEFAULT_MAX_TOKENS_CAP
from bulkinfer.jobs.sampling import JobSampling
from bulkinfer.jobs.spec import JobSpec
from bulkinfer.worker.hosts.engine_rows import ROW_CODES, PreparedBatch, engine_error_code, engine_sampling
from bulkinfer.worker.hosts.prompt_renderer import PromptRenderer, RowRejected


def row(prompt: str | None = None, messages: list | None = None) -> Row:
    return Row(0, "r0", prompt, messages, JobSampling(), None)


def test_supported_knobs_map_one_to_one_and_unset_ones_keep_the_engine_default() -> None:
    job = JobSampling(temperature=0.3, top_p=0.9, top_k=20, seed=7, max_tokens=12, stop_token_ids=[5],
                      ignore_eos=True)
    assert engine_sampling(job) == SamplingParams(temperature=0.3, top_p=0.9, top_k=20, seed=7, max_tokens=12,
                                                  stop_token_ids=[5], ignore_eos=True)
    # No max_tokens: until the answer ends (the engine stops it at the model's context), never the
    # engine's offline default of 16, up to the deployment's cap.
    assert engine_sampling(JobSampling()) == SamplingParams(max_tokens=DEFAULT_MAX_TOKENS_CAP)
    assert engine_sampling(JobSampling(), max_tokens_cap=300) == SamplingParams(max_tokens=300)


def test_a_row_asking_more_than_the_cap_is_refused_naming_it() -> None:
    cap = r"max_tokens 301 is more than this deployment's max_tokens_cap \(300\)"
    with pytest.raises(RowRejected, match=cap) as rejected:
        engine_sampling(JobSampling(max_tokens=301), max_tokens_cap=300)
    assert rejected.value.code == RowErrorCode.INVALID_SAMPLING


def test_every_job_knob_maps_onto_the_engine_field_of_the_same_name() -> None:
    job = JobSampling(n=3, temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, seed=1, max_tokens=9,
                      min_tokens=2, stop=["\n\n", "END"], include_stop_str_in_output=True, stop_token_ids=[4],
                      ignore_eos=False, presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2,
                      logprobs=5, skip_special_tokens=False)
    assert engine_sampling(job) == SamplingParams(
        n=3, temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, seed=1, max_tokens=9, min_tokens=2,
        stop=["\n\n", "END"], include_stop_str_in_output=True, stop_token_ids=[4], ignore_eos=False,
        presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2, logprobs=5,
        skip_special_tokens=False)
    # Every knob a job may set has its engine field: nothing is dropped or refused for lack of one.
    assert set(JobSampling.model_fields) <= {field.name for field in dataclasses.fields(SamplingParams)}


def test_response_formats_become_the_engines_json_schema() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    wire = {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": True}}
    assert engine_sampling(JobSampling(), wire).json_schema == schema
    assert engine_sampling(JobSampling(), {"type": "json_object"}).json_schema is True
    assert engine_sampling(JobSampling(), None).json_schema is None


def test_values_the_engine_refuses_are_row_errors_naming_the_knob() -> None:
    # The job model checks ranges too; the engine's check is the one that counts (min_tokens > max_tokens).
    with pytest.raises(RowRejected, match="min_tokens") as rejected:
        engine_sampling(JobSampling(min_tokens=9, max_tokens=3))
    assert rejected.value.code == RowErrorCode.INVALID_SAMPLING


def test_prompts_are_encoded_as_the_engine_encodes_text_and_chat_goes_through_the_template(
        tiny_checkpoint: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    renderer = PromptRenderer(tokenizer)
    assert renderer.token_ids(row(prompt="def main():")) == tokenizer.encode("def main():")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    rendered = tokenizer.decode(renderer.token_ids(row(messages=messages)))
    assert rendered == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n" \
                       "<|im_start|>assistant\n"


def test_chat_without_a_template_uses_chatml_and_content_it_cannot_render_is_a_row_error(
        tiny_checkpoint: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    audio = [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "x"}}]}]
    with pytest.raises(RowRejected, match="must be a text part") as rejected:
        PromptRenderer(tokenizer).token_ids(row(messages=audio))
    assert rejected.value.code == RowErrorCode.INVALID_ROW
    images = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(RowRejected, match="this model takes no images") as rejected:
        PromptRenderer(tokenizer).token_ids(row(messages=images))
    assert rejected.value.code == RowErrorCode.INVALID_IMAGE
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    with_template = PromptRenderer(tokenizer).token_ids(row(messages=parts))
    tokenizer.chat_template = None
    plain = [{"role": "user", "content": "hi"}]
    assert PromptRenderer(tokenizer).token_ids(row(messages=plain)) == with_template


def test_engine_rejections_get_row_error_codes_from_their_kind_never_their_words() -> None:
    assert engine_error_code(ErrorKind.PROMPT_TOO_LONG) == RowErrorCode.PROMPT_TOO_LONG
    assert engine_error_code(ErrorKind.EMPTY_PROMPT) == RowErrorCode.INVALID_ROW
    assert engine_error_code(ErrorKind.INVALID_PROMPT) == RowErrorCode.INVALID_ROW
    assert engine_error_code(ErrorKind.INVALID_SAMPLING) == RowErrorCode.INVALID_SAMPLING
    # A grammar that does not compile (or not in time, or rejects a token) fails the row as its format.
    assert engine_error_code(ErrorKind.STRUCTURED_OUTPUT) == RowErrorCode.INVALID_RESPONSE_FORMAT
    for kind in (ErrorKind.NON_FINITE_LOGITS, ErrorKind.ENGINE_FAILURE, None, "a-kind-from-a-newer-engine"):
        assert engine_error_code(kind) == RowErrorCode.ENGINE_ERROR
    assert set(ROW_CODES) == set(ErrorKind)  # every kind the engine has is mapped


def test_structured_output_values_the_engine_refuses_are_format_errors() -> None:
    with pytest.raises(RowRejected, match="json_schema") as rejected:
        engine_sampling(JobSampling(), {"type": "json_schema", "json_schema": {"schema": "not a dict"}})
    assert rejected.value.code == RowErrorCode.INVALID_RESPONSE_FORMAT


def test_a_tokenizer_that_raises_on_a_rows_text_fails_that_row_only(tiny_checkpoint: Path) -> None:
    # A Row may hold text the Rust tokenizer cannot take (half a UTF-16 pair); any row from any
    # reader must end as its own error, never as an exception that fails the shard.
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    rows = [Row(n, f"r{n}", prompt, None, JobSampling(temperature=0.0), None)
            for n, prompt in enumerate(["def main():", "half a pair: \ud800", "import os"])]

    batch = PreparedBatch(PromptRenderer(tokenizer), rows)

    assert sorted(list(request.prompt) for request in batch.requests) == sorted(
        [tokenizer.encode("def main():"), tokenizer.encode("import os")])
    [failed] = PreparedBatch(PromptRenderer(tokenizer), rows[1:2]).outputs([])
    assert (failed.row_id, failed.error_code) == ("r1", RowErrorCode.TOKENIZE_ERROR)
    assert "tokenizer failed on this row" in failed.error_message


def _plain_row(record: dict, **spec: object) -> Row:
    built = RowBuilder(JobSpec(input_uri="/in/rows.jsonl", input_format="jsonl", model="m",
                               prompt_column="q", instructions="Answer briefly.", **spec)).build(0, record)
    assert isinstance(built, Row)
    return built


def test_plain_rows_render_through_the_models_chat_template_as_chat_rows_do(real_model: Path,
                                                                           tiny_checkpoint: Path) -> None:
    """prompt_column + instructions on an instruct model: the instructions as the system message,
    the row as the user's turn (what Ray Data LLM and vLLM's LLM.chat send); raw prompts on request,
    and by default on a model without a template."""
    instruct = PromptRenderer(AutoTokenizer.from_pretrained(real_model))
    plain = _plain_row({"q": "What is 2+2?"})
    chat = row(messages=[{"role": "system", "content": "Answer briefly."},
                         {"role": "user", "content": "What is 2+2?"}])
    assert instruct.token_ids(plain) == instruct.token_ids(chat)
    assert instruct.prompt_format(plain) == "chat_template"
    raw = _plain_row({"q": "What is 2+2?"}, apply_chat_template=False)
    assert instruct.token_ids(raw) == instruct._tokenizer.encode("Answer briefly.\n\nWhat is 2+2?")
    assert instruct.prompt_format(raw) == "raw"

    untemplated = AutoTokenizer.from_pretrained(tiny_checkpoint)
    untemplated.chat_template = None  # a base model's tokenizer: no chat template of its own
    base = PromptRenderer(untemplated)
    assert base.prompt_format(plain) == "raw"
    assert base.token_ids(plain) == base._tokenizer.encode("Answer briefly.\n\nWhat is 2+2?")
    forced = _plain_row({"q": "What is 2+2?"}, apply_chat_template=True)
    assert base.prompt_format(forced) == "chatml" and base.token_ids(forced) == base.token_ids(chat)


def test_apply_chat_template_is_for_plain_rows_only() -> None:
    with pytest.raises(ValueError, match="messages_column rows are chat"):
        JobSpec(input_uri="/in/rows.jsonl", model="m", messages_column="m", apply_chat_template=False)
    with pytest.raises(ValueError, match="OpenAI batch lines say it by their url"):
        JobSpec(input_uri="/in/rows.jsonl", input_format="openai_batch", model="m", apply_chat_template=True)
    with pytest.raises(ValueError, match="an embed job embeds each row's text as it is"):
        JobSpec(input_uri="/in/rows.jsonl", model="m", task="embed", prompt_column="q",
                apply_chat_template=True)

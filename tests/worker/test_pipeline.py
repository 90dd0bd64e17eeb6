"""Jobs through the real pipeline: plan → shards → finalize in a Celery worker process, sent by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from anthropic.types.messages import MessageBatchIndividualResponse
from openai.types import Completion

from bulkinfer.engine import LLM, SamplingParams
from bulkinfer.jobs.formats.anthropic_results import anthropic_result
from bulkinfer.jobs.formats.readers import read_shard_rows
from bulkinfer.jobs.object_store import S3ObjectStore
from bulkinfer.jobs.planning.retry import retry_plan
from bulkinfer.jobs.spec import JobSpec
from bulkinfer.jobs.state.status import JobState
from tests.worker.conftest import ENGINE_OPTIONS, INPUTS_BUCKET, MODELS_BUCKET, Pipeline

pytestmark = pytest.mark.timeout(300)

MAX_TOKENS = 5
# Rows share prefixes (and one row repeats), so sorting inside a shard has something to do.
QUESTIONS = ["def add(a, b):", "import sys\n", "def add(a, b, c):", "class Point:", "for i in range(",
             "def add(a, b):", "while True:", "return x +", "import os\n", "if __name__ =="]


@pytest.fixture(scope="module")
def offline(tiny_checkpoint: Path) -> LLM:
    return LLM(str(tiny_checkpoint), **ENGINE_OPTIONS)


def greedy_texts(llm: LLM, prompts: list) -> list[str]:
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    return [output.text for output in outputs]


def test_a_jsonl_job_completes_with_every_row_once_in_order_equal_to_offline_generation(
        pipeline: Pipeline, offline: LLM) -> None:
    lines = [json.dumps({"id": f"q{n}", "question": text}) for n, text in enumerate(QUESTIONS)]
    spec = JobSpec(input_uri=pipeline.put_input("questions.jsonl", lines), model="tiny", id_column="id",
                   prompt_column="question", sampling={"temperature": 0.0, "max_tokens": MAX_TOKENS},
                   shard_size=3, apply_chat_template=False)
    job_id = pipeline.submit(spec)

    status = pipeline.wait_for_end(job_id)

    assert status.state == JobState.SUCCEEDED, status.error
    records = pipeline.output_records(job_id)
    assert [record["id"] for record in records] == [f"q{n}" for n in range(len(QUESTIONS))]
    assert [record["text"] for record in records] == greedy_texts(offline, QUESTIONS)
    assert all(record["error"] is None for record in records)
    assert {record["finish_reason"] for record in records} <= {"length", "stop"}
    manifest = pipeline.manifest(job_id)
    assert len(manifest.parts) == 4
    assert manifest.dtypes == ["float32"] and {part.dtype for part in manifest.parts} == {"float32"}
    # Raw completion prompts, as asked, and the manifest says so.
    assert manifest.prompt_formats == ["raw"]
    assert all(part.prompt_formats == ["raw"] for part in manifest.parts)
    assert (status.rows.total, status.rows.succeeded, status.rows.failed) == (10, 10, 0)
    assert (status.shards.done, status.shards.total) == (4, 4)
    assert status.usage == manifest.usage
    # q5 repeats q0 in another shard: it takes q0's output, and the job counts q0's tokens once.
    assert status.rows.deduplicated == 1 and records[5]["text"] == records[0]["text"]
    assert manifest.usage.completion == sum(r["usage"]["completion_tokens"] for r in records) - \
        records[5]["usage"]["completion_tokens"]
    assert status.output_uris == [part.output.uri for part in manifest.parts]


def test_chat_messages_are_rendered_with_the_chat_template(pipeline: Pipeline, offline: LLM) -> None:
    conversations = [[{"role": "user", "content": text}] for text in QUESTIONS[:4]]
    lines = [json.dumps({"messages": messages}) for messages in conversations]
    spec = JobSpec(input_uri=pipeline.put_input("chat.jsonl", lines), model="tiny",
                   messages_column="messages", instructions="You write Python.",
                   sampling={"temperature": 0.0, "max_tokens": MAX_TOKENS})

    status = pipeline.wait_for_end(pipeline.submit(spec))

    assert status.state == JobState.SUCCEEDED, status.error
    tokenizer = offline.tokenizer
    expected_prompts = [
        tokenizer.encode(tokenizer.apply_chat_template(
            [{"role": "system", "content": "You write Python."}, *messages], tokenize=False,
            add_generation_prompt=True), add_special_tokens=False)
        for messages in conversations]
    records = pipeline.output_records(status.job_id)
    assert [record["text"] for record in records] == greedy_texts(offline, expected_prompts)
    assert records[0]["usage"]["prompt_tokens"] == len(expected_prompts[0])
    assert pipeline.manifest(status.job_id).prompt_formats == ["chat_template"]

    # Plain rows on a model with a chat template run exactly as those chat rows by default: the
    # instructions as the system message, each row's text as the user's turn.
    lines = [json.dumps({"question": text}) for text in QUESTIONS[:4]]
    plain = JobSpec(input_uri=pipeline.put_input("plain.jsonl", lines), model="tiny",
                    prompt_column="question", instructions="You write Python.",
                    sampling={"temperature": 0.0, "max_tokens": MAX_TOKENS})
    status = pipeline.wait_for_end(pipeline.submit(plain))
    assert status.state == JobState.SUCCEEDED, status.error
    assert [record["text"] for record in pipeline.output_records(status.job_id)] == \
        [record["text"] for record in records]
    assert pipeline.manifest(status.job_id).prompt_formats == ["chat_template"]


def test_rows_that_cannot_run_become_row_errors_while_the_job_succeeds(pipeline: Pipeline) -> None:
    rows = [
        {"id": "ok", "question": "def add(a, b):"},
        "{this line is not json",
        {"id": "no-question"},
        {"id": "too-long", "question": "word " * 300},
        {"id": "empty", "question": ""},
        {"id": "min-over-max", "question": "x", "sampling": {"min_tokens": 9}},
        {"id": "penalty", "question": "x", "sampling": {"presence_penalty": 0.5}},
        {"id": "bad-schema", "question": "x", "format": {"type": "json_schema", "json_schema": {
            "name": "bad", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}},
        {"id": "lone-surrogate", "question": "half a pair: \ud800"},  # valid JSON, not Unicode text
        '{"id": "deep", "question": ' + "[" * 100_000 + "]" * 100_000 + "}",  # RecursionError in json
        '{"id": "bigint", "question": "x", "n": ' + "1" * 5000 + "}",  # past Python's int digits limit
    ]
    lines = [row if isinstance(row, str) else json.dumps(row) for row in rows]
    spec = JobSpec(input_uri=pipeline.put_input("mixed.jsonl", lines), model="tiny", id_column="id",
                   template="{question}", sampling_column="sampling", response_format_column="format",
                   sampling={"temperature": 0.0, "max_tokens": MAX_TOKENS}, shard_size=4,
                   apply_chat_template=False)
    bad_json_id = str(len(lines[0]) + 1)  # a line that is not JSON is named by its byte offset
    surrogate_id, deep_id, bigint_id = (str(sum(len(line) + 1 for line in lines[:n])) for n in (8, 9, 10))

    status = pipeline.wait_for_end(pipeline.submit(spec))

    assert status.state == JobState.SUCCEEDED, status.error
    records = pipeline.output_records(status.job_id)
    codes = {record["id"]: (record["error"] or {}).get("code") for record in records}
    assert codes == {"ok": None, "penalty": None, bad_json_id: "invalid_json",
                     "no-question": "missing_column", "too-long": "prompt_too_long", "empty": "invalid_row",
                     "min-over-max": "invalid_sampling", "bad-schema": "invalid_response_format",
                     surrogate_id: "invalid_json", deep_id: "invalid_json", bigint_id: "invalid_json"}
    messages = {record["id"]: (record["error"] or {}).get("message", "") for record in records}
    assert "min_tokens" in messages["min-over-max"] and "max_model_len=256" in messages["too-long"]
    assert "lone UTF-16 surrogate" in messages[surrogate_id]
    assert "nested more than 100 levels" in messages[deep_id] and "too long to read" in messages[bigint_id]
    assert (status.rows.total, status.rows.succeeded, status.rows.failed) == (11, 2, 9)
    errors = pipeline.error_records(status.job_id)
    assert sorted(error["id"] for error in errors) == sorted(k for k, code in codes.items() if code)


def test_a_model_in_s3_is_downloaded_once_and_served(pipeline: Pipeline, tiny_checkpoint: Path,
                                                     offline: LLM) -> None:
    client = pipeline.s3.client()
    for path in sorted(tiny_checkpoint.iterdir()):
        client.upload_file(str(path), MODELS_BUCKET, f"tiny/{path.name}")
    lines = [json.dumps({"q": text}) for text in QUESTIONS[:3]]
    spec = JobSpec(input_uri=pipeline.put_input("s3-model.jsonl", lines), model="tiny-s3", prompt_column="q",
                   sampling={"temperature": 0.0, "max_tokens": MAX_TOKENS}, apply_chat_template=False)

    status = pipeline.wait_for_end(pipeline.submit(spec))

    assert status.state == JobState.SUCCEEDED, status.error
    assert [r["text"] for r in pipeline.output_records(status.job_id)] == greedy_texts(offline, QUESTIONS[:3])


def test_openai_batch_lines_run_unchanged_and_come_back_as_openai_responses(
        pipeline: Pipeline, offline: LLM) -> None:
    lines = [json.dumps({"custom_id": f"req-{n}", "method": "POST", "url": "/v1/completions",
                         "body": {"model": "gpt-4o-mini", "prompt": text, "max_tokens": MAX_TOKENS,
                                  "temperature": 0}})
             for n, text in enumerate(QUESTIONS[:3])]
    lines.append(json.dumps({"custom_id": "req-n", "method": "POST", "url": "/v1/chat/completions",
                             "body": {"messages": [{"role": "user", "content": "hi"}], "n": 2, "seed": 1,
                                      "max_tokens": MAX_TOKENS, "logprobs": True, "top_logprobs": 2}}))
    spec = JobSpec(input_uri=pipeline.put_input("batch.jsonl", lines), model="tiny")

    status = pipeline.wait_for_end(pipeline.submit(spec))

    assert status.state == JobState.SUCCEEDED, status.error
    records = pipeline.output_records(status.job_id)
    assert [record["custom_id"] for record in records] == ["req-0", "req-1", "req-2", "req-n"]
    texts = [record["response"]["body"]["choices"][0]["text"] for record in records[:3]]
    assert texts == greedy_texts(offline, QUESTIONS[:3])
    assert all(record["response"]["body"]["choices"][0]["logprobs"] is None for record in records[:3])
    body = records[3]["response"]["body"]
    assert [choice["index"] for choice in body["choices"]] == [0, 1]
    for choice in body["choices"]:
        content = choice["logprobs"]["content"]
        assert 1 <= len(content) <= MAX_TOKENS
        assert all(len(entry["top_logprobs"]) == 2 and entry["logprob"] <= 0.0 for entry in content)
        # The token bytes spell the text (a sample that stops at EOS has no bytes for it).
        assert bytes(b for entry in content for b in entry["bytes"]).decode(errors="replace") \
            .startswith(choice["message"]["content"])


def test_completions_with_echo_logprobs_and_max_tokens_zero_score_the_prompt(
        pipeline: Pipeline, offline: LLM) -> None:
    """The legacy completions scoring request: the prompt's tokens and logprobs come back, nothing is
    generated; a row that also generates gets its tokens after the prompt's."""
    prompts = QUESTIONS[:2]
    lines = [json.dumps({"custom_id": f"s{n}", "method": "POST", "url": "/v1/completions",
                         "body": {"prompt": text, "echo": True, "logprobs": 2, "max_tokens": tokens,
                                  "temperature": 0}})
             for n, (text, tokens) in enumerate([(prompts[0], 0), (prompts[1], 0), (prompts[0], 3)])]
    spec = JobSpec(input_uri=pipeline.put_input("scoring.jsonl", lines), model="tiny")

    status = pipeline.wait_for_end(pipeline.submit(spec))

    assert status.state == JobState.SUCCEEDED, status.error
    records = pipeline.output_records(status.job_id)
    expected = offline.generate(prompts, SamplingParams(temperature=0.0, max_tokens=0, prompt_logprobs=2))
    tokenizer = offline.tokenizer
    for record, prompt, reference in zip(records, [*prompts, prompts[0]], [*expected, expected[0]],
                                         strict=True):
        [choice] = Completion.construct(**record["response"]["body"]).choices
        assert choice.text.startswith(prompt)
        logprobs = choice.logprobs
        num_prompt = len(reference.prompt_token_ids)
        assert logprobs.tokens[:num_prompt] == [tokenizer.decode([t]) for t in reference.prompt_token_ids]
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        assert logprobs.token_logprobs[1:num_prompt] == pytest.approx(
            [p.chosen.logprob for p in reference.prompt_logprobs[1:]], abs=1e-5)
        assert all(2 <= len(top) <= 3 for top in logprobs.top_logprobs[1:])
        assert logprobs.text_offset[:num_prompt] == [len(tokenizer.decode(reference.prompt_token_ids[:i]))
                                                     for i in range(num_prompt)]
    assert [record["response"]["body"]["usage"]["completion_tokens"] for record in records] == [0, 0, 3]
    generated = records[2]["response"]["body"]["choices"][0]
    [three] = offline.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=3))
    assert generated["text"] == prompts[0] + three.text
    assert len(generated["logprobs"]["tokens"]) == len(expected[0].prompt_token_ids) + 3


def test_a_parquet_job_writes_parquet_parts_in_input_order(pipeline: Pipeline, offline: LLM,
                                                           tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"id": [f"p{n}" for n in range(len(QUESTIONS))], "question": QUESTIONS})
    pq.write_table(table, tmp_path / "questions.parquet", row_group_size=4)
    pipeline.s3.client().upload_file(str(tmp_path / "questions.parquet"), INPUTS_BUCKET, "questions.parquet")
    spec = JobSpec(input_uri=f"s3://{INPUTS_BUCKET}/questions.parquet", model="tiny", id_column="id",
                   prompt_column="question", sampling={"temperature": 0.0, "max_tokens": MAX_TOKENS},
                   shard_size=4, apply_chat_template=False)

    status = pipeline.wait_for_end(pipeline.submit(spec))

    assert status.state == JobState.SUCCEEDED, status.error
    parts = [pq.read_table(pa.BufferReader(pipeline.repository.store.get_bytes(part.output.key)))
             for part in pipeline.manifest(status.job_id).parts]
    output = pa.concat_tables(parts).to_pydict()
    assert output["id"] == [f"p{n}" for n in range(len(QUESTIONS))]
    assert output["text"] == greedy_texts(offline, QUESTIONS)


VERDICT_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["verdict", "ok"],
                  "properties": {"verdict": {"enum": ["yes", "no", "maybe"]}, "ok": {"type": "boolean"}}}


def stop_string_in(text: str) -> str:
    """Three characters from the middle of `text` (whole characters, no newline), to stop on."""
    for start in range(3, len(text) - 3):
        candidate = text[start:start + 3]
        if "\ufffd" not in candidate and "\n" not in candidate and text.find(candidate) == start:
            return candidate
    raise AssertionError(f"no stop string candidate in {text!r}")


def test_stop_strings_n_samples_logprobs_and_json_schema_run_and_are_written(
        pipeline: Pipeline, offline: LLM) -> None:
    import jsonschema

    prompt = QUESTIONS[0]
    [greedy] = offline.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16))
    stop = stop_string_in(greedy.text)
    sampled = {"n": 2, "temperature": 1.0, "seed": 11, "max_tokens": 6, "logprobs": 3}
    json_format = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": VERDICT_SCHEMA}}
    rows = [
        {"id": "stop", "question": prompt, "sampling": {"stop": ["never-there", stop]}},
        {"id": "stop-kept", "question": prompt,
         "sampling": {"stop": stop, "include_stop_str_in_output": True}},
        {"id": "n-logprobs", "question": prompt, "sampling": sampled},
        {"id": "json", "question": "Is it so?", "format": json_format,
         "sampling": {"n": 2, "temperature": 0.8, "seed": 2, "max_tokens": 48}},
    ]
    input_uri = pipeline.put_input("knobs.jsonl", [json.dumps(row) for row in rows])
    spec = JobSpec(input_uri=input_uri, model="tiny", id_column="id", prompt_column="question",
                   sampling_column="sampling", response_format_column="format",
                   sampling={"temperature": 0.0, "max_tokens": 16}, apply_chat_template=False)

    status = pipeline.wait_for_end(pipeline.submit(spec))

    assert status.state == JobState.SUCCEEDED, status.error
    records = {record["id"]: record for record in pipeline.output_records(status.job_id)}
    assert all(record["error"] is None for record in records.values()), records
    # Stop strings: cut before the match (after it when kept), across token boundaries.
    cut = greedy.text.index(stop)
    assert (records["stop"]["text"], records["stop"]["finish_reason"]) == (greedy.text[:cut], "stop")
    assert records["stop-kept"]["text"] == greedy.text[:cut + len(stop)]
    assert "logprobs" not in records["stop"] and "choices" not in records["stop"]
    # n = 2 with logprobs: the offline engine's samples (seeded), each with 3 alternatives per token.
    [expected] = offline.generate([prompt], SamplingParams(**sampled))
    record = records["n-logprobs"]
    assert [choice["text"] for choice in record["choices"]] == [sample.text for sample in expected.outputs]
    assert record["text"] == expected.outputs[0].text
    assert record["logprobs"] == record["choices"][0]["logprobs"]
    for choice, sample in zip(record["choices"], expected.outputs, strict=True):
        assert [entry["token_id"] for entry in choice["logprobs"]] == sample.token_ids
        assert all(len(entry["top_logprobs"]) == 3 for entry in choice["logprobs"])
        assert [entry["logprob"] for entry in choice["logprobs"]] == pytest.approx(
            [position.chosen.logprob for position in sample.logprobs], abs=1e-4)
    assert record["usage"]["completion_tokens"] == sum(len(sample.token_ids) for sample in expected.outputs)
    # json_schema: every sample is JSON that validates against the schema, written parsed.
    record = records["json"]
    assert len(record["choices"]) == 2 and record["json"] == record["choices"][0]["json"]
    for choice in record["choices"]:
        assert choice["finish_reason"] == "stop"
        assert json.loads(choice["text"]) == choice["json"]
        jsonschema.validate(choice["json"], VERDICT_SCHEMA)


DUPLICATED = ["def add(a, b):", "class Point:", "def add(a, b):", "def add(a, b):", "class Point:",
              "import os\n"]


@pytest.mark.parametrize(("sampling", "deduplicate", "merged", "shard_size"), [
    ({"temperature": 0.0}, True, 3, 1000),  # greedy: the same output every time
    ({"temperature": 1.0, "seed": 7}, True, 3, 1000),  # seeded: the same too
    ({"temperature": 1.0}, True, 0, 1000),  # random and unseeded: each row draws its own
    ({"temperature": 0.0}, False, 0, 1000),  # turned off in the spec
    # Across shards: rows 2 and 3 (shard 1) copy row 0 (shard 0), row 4 (shard 2) copies row 1.
    ({"temperature": 0.0}, True, 3, 2),
    ({"temperature": 1.0, "logprobs": 2, "seed": 3}, True, 3, 2),  # with logprobs, through the export file
])
def test_identical_deterministic_rows_run_once_and_each_row_gets_the_output(
        pipeline: Pipeline, offline: LLM, sampling: dict, deduplicate: bool, merged: int,
        shard_size: int) -> None:
    lines = [json.dumps({"id": f"r{n}", "question": text, "tag": n}) for n, text in enumerate(DUPLICATED)]
    spec = JobSpec(input_uri=pipeline.put_input("duplicated.jsonl", lines), model="tiny", id_column="id",
                   prompt_column="question", passthrough_columns=["tag"], deduplicate=deduplicate,
                   sampling={**sampling, "max_tokens": MAX_TOKENS}, shard_size=shard_size,
                   apply_chat_template=False)
    status = pipeline.wait_for_end(pipeline.submit(spec))
    assert status.state == JobState.SUCCEEDED, status.error
    assert status.rows.deduplicated == merged and pipeline.manifest(status.job_id).rows.deduplicated == merged
    records = pipeline.output_records(status.job_id)
    assert [(r["id"], r["tag"]) for r in records] == [(f"r{n}", n) for n in range(len(DUPLICATED))]
    if merged:  # every copy has its first row's text and token counts
        for copy, first in ((2, 0), (3, 0), (4, 1)):
            assert (records[copy]["text"], records[copy]["usage"]) == (records[first]["text"],
                                                                       records[first]["usage"])
            assert records[copy].get("logprobs") == records[first].get("logprobs")
        # The job counts the tokens of the rows that ran, not of their copies.
        assert status.usage.completion == sum(r["usage"]["completion_tokens"] for r in records) - sum(
            records[copy]["usage"]["completion_tokens"] for copy in (2, 3, 4))
    if sampling["temperature"] == 0.0:
        assert [record["text"] for record in records] == greedy_texts(offline, DUPLICATED)


def test_anthropic_messages_lines_run_beside_chat_lines_and_translate_to_anthropic_results(
        pipeline: Pipeline, offline: LLM) -> None:
    """An Anthropic batch runs as `/v1/messages` lines of an OpenAI-batch job: each comes back with the
    stop string that ended it (`stop_reason`), and its record becomes the Anthropic result the SDK
    parses: `stop_sequence` when a stop sequence matched; a refused parameter is that request's error."""
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTIONS[0]}]
    tokenizer = offline.tokenizer
    rendered = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    prompt = tokenizer.encode(rendered, add_special_tokens=False)
    [greedy] = offline.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16))
    stop = stop_string_in(greedy.text)
    params = {"model": "tiny", "max_tokens": 16, "temperature": 0, "system": "Be brief.",
              "messages": [{"role": "user", "content": [{"type": "text", "text": QUESTIONS[0]}]}]}
    requests = [("m-stop", "/v1/messages", {**params, "stop_sequences": ["never-there", stop]}),
                ("m-full", "/v1/messages", params),
                ("m-tools", "/v1/messages", {**params, "tools": [{"name": "f", "input_schema": {}}]}),
                ("c-full", "/v1/chat/completions", {"model": "gpt-4o-mini", "messages": conversation,
                                                    "max_tokens": 16, "temperature": 0})]
    lines = [json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})
             for custom_id, url, body in requests]
    spec = JobSpec(input_uri=pipeline.put_input("anthropic.jsonl", lines), model="tiny",
                   input_format="openai_batch")

    status = pipeline.wait_for_end(pipeline.submit(spec))

    assert status.state == JobState.SUCCEEDED, status.error
    records = {record["custom_id"]: record for record in pipeline.output_records(status.job_id)}
    assert list(records) == ["m-stop", "m-full", "m-tools", "c-full"]
    cut = greedy.text.index(stop)
    [choice] = records["m-stop"]["response"]["body"]["choices"]
    assert (choice["message"]["content"], choice["finish_reason"], choice["stop_reason"]) == (
        greedy.text[:cut], "stop", stop)
    # The same conversation as an OpenAI chat line: the same answer (run once: identical and greedy).
    for custom_id in ("m-full", "c-full"):
        [choice] = records[custom_id]["response"]["body"]["choices"]
        assert (choice["message"]["content"], choice["stop_reason"]) == (greedy.text, None)
    assert status.rows.deduplicated == 1

    results = {custom_id: MessageBatchIndividualResponse.model_validate(anthropic_result(record, "tiny"))
               for custom_id, record in records.items() if custom_id.startswith("m-")}
    stopped = results["m-stop"].result
    assert stopped.type == "succeeded" and stopped.message.content[0].text == greedy.text[:cut]
    assert (stopped.message.stop_reason, stopped.message.stop_sequence) == ("stop_sequence", stop)
    usage = stopped.message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == len(prompt)
    assert 0 < usage.output_tokens < 16
    full = results["m-full"].result.message
    assert full.content[0].text == greedy.text and full.stop_sequence is None
    assert full.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[greedy.finish_reason]
    refused = results["m-tools"].result
    assert refused.type == "errored" and refused.error.error.type == "invalid_request_error"
    assert "no tool-call format" in refused.error.error.message  # tiny's template has none

    # A retry of the failed requests runs the refused /v1/messages line again, and only it.
    inputs = S3ObjectStore(INPUTS_BUCKET, client=pipeline.s3.client())
    retried = [item for shard in retry_plan(pipeline.repository, status.job_id)
               for item in read_shard_rows(inputs, "anthropic.jsonl", spec, shard)]
    assert [item.row_id for item in retried] == ["m-tools"]  # read again; the worker refuses its tools again

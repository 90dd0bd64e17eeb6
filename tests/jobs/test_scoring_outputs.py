"""Scoring (prompt_logprobs) through the job formats: OpenAI bodies and `echo`, and every writer."""

from __future__ import annotations

import io
import json
import math

import pyarrow.parquet as pq
from openai.types import Completion, CompletionChoice
from openai.types.completion_choice import Logprobs

from bulkinfer.jobs.formats.openai_batch_writer import openai_batch_record
from bulkinfer.jobs.formats.output import Choice, OutputRow, PositionLogprobs, PromptLogprobs, TokenLogprob
from bulkinfer.jobs.formats.parts import write_output_part
from bulkinfer.jobs.formats.rows import INSTRUCTIONS_SEPARATOR, Row, RowBuilder, RowErrorCode
from bulkinfer.jobs.planning.job_dedup import dump_outputs, load_outputs
from bulkinfer.jobs.spec import JobSpec
from tests.jobs.test_openai_batch import read, request


def parse_completion(body: dict) -> Completion:
    """The body as the official client reads a response: `construct` (its response parsing, which
    does not validate). Strict validation would refuse the null logprob of the first prompt token,
    which the legacy API itself sent: the package annotates `token_logprobs` as floats only."""
    completion = Completion.construct(**body)
    assert all(isinstance(choice, CompletionChoice) and isinstance(choice.logprobs, Logprobs)
               for choice in completion.choices)
    return completion


def entry(text: str, logprob: float) -> TokenLogprob:
    return TokenLogprob(token_id=len(text), token=text, logprob=logprob, bytes=list(text.encode()))


def scored(first: str, rest: list[tuple[str, float, list[tuple[str, float]]]]) -> PromptLogprobs:
    """A prompt of tokens `first` then `rest` (text, logprob, top alternatives)."""
    return PromptLogprobs(len(first), first, list(first.encode()),
                          [PositionLogprobs(entry(text, lp), [entry(t, v) for t, v in top])
                           for text, lp, top in rest])


def test_completions_echo_with_logprobs_asks_for_the_prompts_logprobs(local_store) -> None:
    echo, explicit, chat, plain = read(local_store, [
        request("a", url="/v1/completions", prompt="Paris is", echo=True, logprobs=2, max_tokens=0),
        request("b", url="/v1/completions", prompt="x", echo=True, logprobs=1, prompt_logprobs=4),
        request("c", messages=[{"role": "user", "content": "x"}], prompt_logprobs=0),
        request("d", url="/v1/completions", prompt="x", echo=True),
    ])
    assert echo.echo and echo.prompt == "Answer briefly." + INSTRUCTIONS_SEPARATOR + "Paris is"
    assert echo.sampling.as_dict() == {"temperature": 0.0, "max_tokens": 0, "logprobs": 2,
                                       "prompt_logprobs": 2}
    assert explicit.sampling.prompt_logprobs == 4  # vLLM's own field wins over echo's default
    assert chat.sampling.prompt_logprobs == 0 and not chat.echo
    assert plain.echo and plain.sampling.prompt_logprobs is None  # echo alone: the text only


def test_echo_and_scoring_fields_are_checked(local_store) -> None:
    items = read(local_store, [
        request("a", messages=[{"role": "user", "content": "x"}], echo=True),
        request("b", url="/v1/completions", prompt="x", echo="yes"),
        request("c", url="/v1/completions", prompt="x", max_tokens=-1),
        request("d", url="/v1/completions", prompt="x", prompt_logprobs=21),
    ])
    assert [(item.row_id, item.code) for item in items] == [
        ("a", RowErrorCode.INVALID_ROW), ("b", RowErrorCode.INVALID_ROW),
        ("c", RowErrorCode.INVALID_SAMPLING), ("d", RowErrorCode.INVALID_SAMPLING)]
    assert items[0].message == "body.echo is not supported here"  # chat has no echo
    assert items[1].message == "body.echo must be true or false, got 'yes'"
    assert items[3].message == "body: prompt_logprobs: Input should be less than or equal to 20"


def echoed_row(local_store, n: int = 1) -> OutputRow:
    [row] = read(local_store, [request("a", url="/v1/completions", prompt="Hé there", echo=True, logprobs=1,
                                       max_tokens=2, n=n)])
    prompt = scored("Answer", [(" briefly.", -3.5, [(" now", -0.5)]), ("é", -1.25, [("é", -1.25)])])
    completion = [PositionLogprobs(entry(" Hi", -0.2), [entry(" Hi", -0.2)]),
                  PositionLogprobs(entry("!", -0.7), [entry("?", -0.6)])]
    choices = [Choice(i, " Hi!", "length", completion) for i in range(n)]
    return OutputRow.with_choices(row, choices, prompt_tokens=3, cached_tokens=0, completion_tokens=2 * n,
                                  prompt_logprobs=prompt)


def test_echo_returns_the_prompt_then_the_completion_in_the_legacy_shape(local_store) -> None:
    row = echoed_row(local_store, n=2)
    body = openai_batch_record(row, job_id="j", model="m", created=0)["response"]["body"]
    completion = parse_completion(body)
    prompt_text = "Answer briefly." + INSTRUCTIONS_SEPARATOR + "Hé there"
    for choice in completion.choices:
        assert choice.text == prompt_text + " Hi!"
        assert choice.logprobs.tokens == ["Answer", " briefly.", "é", " Hi", "!"]
        assert choice.logprobs.token_logprobs == [None, -3.5, -1.25, -0.2, -0.7]
        assert choice.logprobs.top_logprobs == [None, {" now": -0.5, " briefly.": -3.5}, {"é": -1.25},
                                                {" Hi": -0.2}, {"?": -0.6, "!": -0.7}]
        assert choice.logprobs.text_offset == [0, 6, 15, 16, 19]
        assert choice.finish_reason == "length"


def test_echo_with_max_tokens_zero_scores_the_prompt_only(local_store) -> None:
    [row] = read(local_store, [request("a", url="/v1/completions", prompt="x", echo=True, logprobs=0,
                                       max_tokens=0)])
    output = OutputRow.with_choices(row, [Choice(0, "", "length", [])], prompt_tokens=2, cached_tokens=0,
                                    completion_tokens=0, prompt_logprobs=scored("A", [("b", -2.0, [])]))
    body = openai_batch_record(output, job_id="j", model="m", created=0)["response"]["body"]
    [choice] = parse_completion(body).choices
    assert choice.text == row.prompt
    assert choice.logprobs.tokens == ["A", "b"] and choice.logprobs.token_logprobs == [None, -2.0]
    assert body["usage"]["completion_tokens"] == 0


def test_a_row_without_echo_gets_no_prompt_in_its_text(local_store) -> None:
    [row] = read(local_store, [request("a", url="/v1/completions", prompt="x", logprobs=0,
                                       prompt_logprobs=0)])
    output = OutputRow.with_choices(row, [Choice(0, "y", "stop", [PositionLogprobs(entry("y", -1.0), [])])],
                                    prompt_tokens=2, cached_tokens=0, completion_tokens=1,
                                    prompt_logprobs=scored("A", [("b", -2.0, [])]))
    [choice] = openai_batch_record(output, job_id="j", model="m", created=0)["response"]["body"]["choices"]
    assert choice["text"] == "y" and choice["logprobs"]["tokens"] == ["y"]


def job(output_format: str, **sampling) -> JobSpec:
    return JobSpec.model_validate({"input_uri": "/in/rows.jsonl", "input_format": "jsonl", "model": "m",
                                   "prompt_column": "q", "output_format": output_format,
                                   "sampling": sampling})


def scored_row(spec: JobSpec, index: int) -> OutputRow:
    row = RowBuilder(spec).build(index, {"q": "Paris is"})
    assert isinstance(row, Row)
    return OutputRow.with_choices(row, [Choice(0, "", "length")], prompt_tokens=3, cached_tokens=0,
                                  completion_tokens=0,
                                  prompt_logprobs=scored("Paris", [(" is", -0.5, [(" is", -0.5),
                                                                                   (" was", -2.0)])]))


def test_jsonl_and_parquet_outputs_carry_prompt_logprobs(local_store) -> None:
    jsonl = job("jsonl", max_tokens=0, prompt_logprobs=2)
    write_output_part(local_store, "p.jsonl", [scored_row(jsonl, 0)], jsonl, job_id="j")
    [line] = [json.loads(text) for text in local_store.get_bytes("p.jsonl").splitlines()]
    assert line["prompt_logprobs"] == [None, {
        "token": " is", "token_id": 3, "logprob": -0.5, "bytes": [32, 105, 115],
        "top_logprobs": [{"token": " is", "token_id": 3, "logprob": -0.5, "bytes": [32, 105, 115]},
                         {"token": " was", "token_id": 4, "logprob": -2.0, "bytes": [32, 119, 97, 115]}]}]
    assert line["text"] == "" and line["finish_reason"] == "length"

    parquet = job("parquet", max_tokens=0, prompt_logprobs=2)
    unscored = job("parquet")
    plain_row = OutputRow.completed(RowBuilder(unscored).build(1, {"q": "x"}), "y", "stop", prompt_tokens=1,
                                    cached_tokens=0, completion_tokens=1)
    write_output_part(local_store, "p.parquet", [scored_row(parquet, 0), plain_row], parquet, job_id="j")
    table = pq.read_table(io.BytesIO(local_store.get_bytes("p.parquet")))
    first, second = table.column("prompt_logprobs").to_pylist()
    assert first[0] is None and first[1]["token"] == " is" and first[1]["bytes"] == b" is"
    assert [t["logprob"] for t in first[1]["top_logprobs"]] == [-0.5, -2.0]
    assert second is None  # a row that did not ask
    # A job whose rows cannot ask has no such column.
    write_output_part(local_store, "q.parquet", [plain_row], unscored, job_id="j")
    assert "prompt_logprobs" not in pq.read_table(io.BytesIO(local_store.get_bytes("q.parquet"))).column_names


def test_prompt_logprobs_survive_the_cross_shard_dedup_export(local_store) -> None:
    original = echoed_row(local_store)
    [copy] = load_outputs(dump_outputs({0: original})).values()
    assert copy.prompt_logprobs == original.prompt_logprobs and copy.echo_prompt == original.echo_prompt
    assert not math.isnan(copy.prompt_logprobs.positions[0].chosen.logprob)

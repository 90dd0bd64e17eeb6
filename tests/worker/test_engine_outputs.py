"""Engine outputs to job output rows: every sample a choice, logprobs carried over, failures as row errors."""

from __future__ import annotations

from bulkinfer.engine import CompletionOutput, ErrorKind, PositionLogprobs, RequestOutput, TokenLogprob
from bulkinfer.jobs.formats.output import TokenLogprob as JobTokenLogprob
from bulkinfer.jobs.formats.rows import Row
from bulkinfer.jobs.sampling import JobSampling
from bulkinfer.worker.hosts.engine_rows import output_row

ROW = Row(3, "r3", None, [{"role": "user", "content": "hi"}], JobSampling(), {"type": "json_object"})


def request_output(outputs: list[CompletionOutput], finish_reason: str = "stop",
                   error: str | None = None, error_kind: ErrorKind | None = None) -> RequestOutput:
    return RequestOutput("id", None, [1, 2], outputs[0].text, outputs[0].token_ids, finish_reason, error,
                         num_prompt_tokens=2, num_cached_tokens=1,
                         num_completion_tokens=sum(len(o.token_ids) for o in outputs), metrics=None,
                         outputs=outputs, error_kind=error_kind)


def test_every_sample_becomes_a_choice_in_index_order_with_its_logprobs() -> None:
    chosen = TokenLogprob(token_id=7, token="{}", logprob=-0.25, bytes=[123, 125])
    logprobs = [PositionLogprobs(chosen=chosen, top=[chosen])]
    samples = [CompletionOutput(1, '{"a": 1}', [5, 6], "length"),
               CompletionOutput(0, "{}", [7], "stop", logprobs=logprobs)]

    row = output_row(ROW, request_output(samples))

    assert [(c.index, c.text, c.finish_reason, c.json_value) for c in row.choices] == [
        (0, "{}", "stop", {}), (1, '{"a": 1}', "length", {"a": 1})]
    assert (row.text, row.json_value, row.finish_reason) == ("{}", {}, "stop")
    assert row.logprobs[0].chosen == JobTokenLogprob(7, "{}", -0.25, [123, 125])
    assert row.choices[1].logprobs is None
    assert (row.prompt_tokens, row.cached_tokens, row.completion_tokens) == (2, 1, 3)
    assert row.is_chat and not row.failed


def test_each_choice_carries_the_stop_string_or_token_that_ended_it() -> None:
    """vLLM's `stop_reason`: which stop string or stop token id matched (None at EOS or a length end);
    an Anthropic result tells `stop_sequence` from `end_turn` by it."""
    plain = Row(0, "r0", "p", None, JobSampling(), None)
    samples = [CompletionOutput(0, "a", [1], "stop", stop_reason="\n\n"),
               CompletionOutput(1, "b", [2], "stop", stop_reason=13),
               CompletionOutput(2, "c", [3], "stop"), CompletionOutput(3, "d", [4], "length")]

    row = output_row(plain, request_output(samples))

    assert [choice.stop_reason for choice in row.choices] == ["\n\n", 13, None, None]
    assert row.stop_reason == "\n\n"  # choice 0's, as text and finish_reason


def test_a_failed_sample_fails_the_row_with_the_engines_reason() -> None:
    message = "structured output: the grammar failed to compile: unsupported keyword"
    samples = [CompletionOutput(0, "", [], "error"), CompletionOutput(1, "", [], "error")]
    row = output_row(ROW, request_output(samples, finish_reason="error", error=message,
                                         error_kind=ErrorKind.STRUCTURED_OUTPUT))
    assert row.failed and row.error_code == "invalid_response_format" and row.error_message == message
    aborted = output_row(ROW, request_output([CompletionOutput(0, "x", [1], "abort")], finish_reason="abort"))
    assert aborted.error_code == "engine_error" and aborted.error_message == "aborted by the worker"


class OneTokenRenderer:
    """Stands in for `PromptRenderer.token_text` (the model's tokenizer)."""

    def token_text(self, token_id: int) -> tuple[str, list[int]]:
        return f"<{token_id}>", list(f"<{token_id}>".encode())


def test_a_scored_prompt_comes_with_its_first_token_named_and_echo_keeps_the_prompt() -> None:
    second = TokenLogprob(token_id=2, token="b", logprob=-1.5, bytes=[98], rank=4)
    result = request_output([CompletionOutput(0, "", [], "length", logprobs=[])], finish_reason="length")
    result.prompt_logprobs = [None, PositionLogprobs(chosen=second, top=[])]
    row = Row(0, "r0", "ab", None, JobSampling(max_tokens=0, prompt_logprobs=0), None, echo=True)

    output = output_row(row, result, renderer=OneTokenRenderer())

    prompt = output.prompt_logprobs
    assert (prompt.first_token_id, prompt.first_token, prompt.first_bytes) == (1, "<1>", [60, 49, 62])
    assert [p.chosen for p in prompt.positions] == [JobTokenLogprob(2, "b", -1.5, [98])]
    assert output.echo_prompt == "ab" and output.text == "" and output.finish_reason == "length"
    # A row that did not ask has neither.
    plain = output_row(ROW, request_output([CompletionOutput(0, "{}", [7], "stop")]))
    assert plain.prompt_logprobs is None and plain.echo_prompt is None

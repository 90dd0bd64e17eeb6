"""An engine `RequestOutput` as a job `OutputRow`: one choice per sample, logprobs in the jobs' form."""

from __future__ import annotations

from collections.abc import Sequence

from engine import RequestOutput
from jobs.formats.output import Choice, OutputRow, PositionLogprobs, TokenLogprob
from jobs.formats.rows import Row
from worker.prompts import engine_error_code

FAILED = ("error", "abort")


def output_row(row: Row, result: RequestOutput) -> OutputRow:
    """The row's outcome: every sample as a choice, or the engine's error when any sample failed
    (a grammar that does not compile fails them all; an aborted request aborts them all)."""
    outputs = list(getattr(result, "outputs", None) or [])
    reasons = [result.finish_reason, *(output.finish_reason for output in outputs)]
    failed = next((reason for reason in reasons if reason in FAILED), None)
    if failed is not None:
        message = result.error or ("aborted by the worker" if failed == "abort" else "the engine failed")
        return OutputRow.engine_failed(row, engine_error_code(result.error), message)
    if outputs:
        choices = [Choice(out.index, out.text, out.finish_reason or "stop", _logprobs(out.logprobs))
                   for out in sorted(outputs, key=lambda out: out.index)]
    else:  # an engine that reports one sample only on the request itself
        choices = [Choice(0, result.text, result.finish_reason or "stop")]
    return OutputRow.with_choices(row, choices, prompt_tokens=result.num_prompt_tokens,
                                  cached_tokens=result.num_cached_tokens,
                                  completion_tokens=result.num_completion_tokens)


def _logprobs(positions: Sequence | None) -> list[PositionLogprobs] | None:
    if positions is None:
        return None
    return [PositionLogprobs(_token(position.chosen), [_token(entry) for entry in position.top])
            for position in positions]


def _token(entry) -> TokenLogprob:  # noqa: ANN001 - engine.outputs.TokenLogprob
    return TokenLogprob(entry.token_id, entry.token, float(entry.logprob), list(entry.bytes))

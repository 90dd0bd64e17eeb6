"""Job rows to engine requests and back: `PreparedBatch` readies a batch of rows for the engine (the
shard runner's and `bulkinfer run`'s alike); an engine `RequestOutput` becomes a job `OutputRow`, one
choice per sample, logprobs in the jobs' form.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine import RequestOutput
from jobs.formats.output import Choice, OutputRow, PositionLogprobs, TokenLogprob
from jobs.formats.rows import Row, RowError
from worker.engine_host import EngineRequest
from worker.prompts import PromptRenderer, RowRejected, engine_error_code, engine_sampling

FAILED = ("error", "abort")


@dataclass(frozen=True)
class PreparedRow:
    position: int  # in the batch's input order
    row: Row
    request: EngineRequest


class PreparedBatch:
    """A batch of rows readied for the engine: the outcomes of rows that cannot run (a read error, a
    rejected sampling or prompt), and a request for each of the rest.
    """

    def __init__(self, renderer: PromptRenderer, items: Sequence[Row | RowError], priority: int = 0) -> None:
        self._outputs: list[OutputRow | None] = [None] * len(items)
        prepared: list[PreparedRow] = []
        for position, item in enumerate(items):
            if isinstance(item, RowError):
                self._outputs[position] = OutputRow.from_error(item)
                continue
            try:
                params = engine_sampling(item.sampling, item.response_format)
                request = EngineRequest(renderer.token_ids(item), params, priority)
            except RowRejected as rejected:
                self._outputs[position] = OutputRow.engine_failed(item, rejected.code, str(rejected))
                continue
            prepared.append(PreparedRow(position, item, request))
        # Rows sharing a prefix enter the engine together, so later ones hit the prefix cache.
        prepared.sort(key=lambda entry: list(entry.request.prompt))
        self._prepared = prepared

    @property
    def requests(self) -> list[EngineRequest]:
        """What to submit, in the order `outputs` takes the results back."""
        return [entry.request for entry in self._prepared]

    def outputs(self, results: Sequence[RequestOutput]) -> list[OutputRow]:
        """Every row's outcome in input order, given the engine's results for `requests`."""
        outputs = list(self._outputs)
        for entry, result in zip(self._prepared, results, strict=True):
            outputs[entry.position] = output_row(entry.row, result)
        return [output for output in outputs if output is not None]


def output_row(row: Row, result: RequestOutput) -> OutputRow:
    """The row's outcome: every sample as a choice, or the engine's error when any sample failed
    (a grammar that does not compile fails them all; an aborted request aborts them all)."""
    outputs = list(getattr(result, "outputs", None) or [])
    reasons = [result.finish_reason, *(output.finish_reason for output in outputs)]
    failed = next((reason for reason in reasons if reason in FAILED), None)
    if failed is not None:
        message = result.error or ("aborted by the worker" if failed == "abort" else "the engine failed")
        return OutputRow.engine_failed(row, engine_error_code(result.error_kind), message)
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

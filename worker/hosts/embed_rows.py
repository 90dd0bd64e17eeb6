"""Between an embed job's rows and an `EmbedHost`, both ways: rows -> inputs -> vectors -> output rows.

`EmbedRun` is `EngineRun`'s counterpart (same calls: `wait`, `outputs`, `abort`, `rows`), so the
shard runner's window loop (worker/hosts/row_window.py) and `bulkinfer run` drive either. With
`deduplicate`, a row identical to an earlier row of the run (same inputs, truncate, dimensions,
pooling, normalize and max_length) is not sent again and takes that row's vectors (`OutputRow.deduplicated`);
identical inputs of different rows waiting in the host together are embedded once there too.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from bulkinfer.jobs.embedding import shorten
from bulkinfer.jobs.formats.output import OutputRow, expired_row
from bulkinfer.jobs.formats.rows import Row, RowError, RowErrorCode
from bulkinfer.jobs.state.live_progress import LiveFigures
from bulkinfer.worker.hosts.embed_host import EmbedHost, EmbedInputRequest, EmbedResult, EmbedSubmission
from bulkinfer.worker.hosts.engine_rows import MAX_REMEMBERED_REQUESTS
from bulkinfer.worker.hosts.finished_rows import FinishedRows, copies_of

if TYPE_CHECKING:
    from bulkinfer.worker.hosts.model_hosts import HostedModel

NOT_EMBED_ROW = ("this row asks to generate text, and model {model!r} is an embedding model: it only embeds "
                 "(an embed job, or /v1/embeddings lines)")


@dataclass(frozen=True)
class _Span:
    position: int  # in the batch's input order
    row: Row
    start: int  # its first input among the submitted requests
    count: int


def row_digest(row: Row) -> bytes:
    """Rows with equal digests get equal vectors."""
    embed = row.embed
    key = (repr((embed.inputs, embed.truncate, embed.dimensions, embed.pooling, embed.normalize,
                 embed.max_length)) if embed is not None else "")
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()[:16]


class EmbedRun:
    """A batch of embed rows in a hosted embedder: every input submitted at once; `outputs()` gives
    every row's outcome in input order when done."""

    def __init__(self, hosted: HostedModel, items: Sequence[Row | RowError], priority: int = 0,
                 deduplicate: bool = True, known: dict[bytes, int] | None = None, offset: int = 0,
                 cache_salt: str | None = None) -> None:
        # priority: lower runs sooner (the engine's convention); cache_salt: an embedder has no prefix cache.
        self.rows = len(items)
        self._model = hosted.name
        self._outputs: list[OutputRow | None] = [None] * len(items)
        self._spans: list[_Span] = []
        self._copies: list[tuple[int, Row, int]] = []  # (position, row, position of the row it copies)
        self._earlier_copies: list[tuple[int, Row, int]] = []  # (position, row, run position copied)
        first_of = {} if known is None else known
        requests: list[EmbedInputRequest] = []
        for position, item in enumerate(items):
            if isinstance(item, RowError):
                self._outputs[position] = OutputRow.from_error(item)
                continue
            if item.embed is None:
                self._outputs[position] = OutputRow.engine_failed(item, RowErrorCode.INVALID_ROW,
                                                                  NOT_EMBED_ROW.format(model=hosted.name))
                continue
            if deduplicate:
                digest = row_digest(item)
                source = first_of.get(digest)
                if source is not None:
                    target = self._copies if source >= offset else self._earlier_copies
                    target.append((position, item, source - offset if source >= offset else source))
                    continue
                if len(first_of) < MAX_REMEMBERED_REQUESTS:
                    first_of[digest] = offset + position
            self._spans.append(_Span(position, item, len(requests), len(item.embed.inputs)))
            embed = item.embed
            requests += [EmbedInputRequest(value, embed.truncate, embed.pooling, embed.normalize, priority,
                                           embed.max_length) for value in embed.inputs]
        host = cast("EmbedHost", hosted.host)  # an embedding model's rows: HostedModel gave it an embedder
        self.submission: EmbedSubmission | None = host.submit(requests) if requests else None
        futures = self.submission.futures if self.submission is not None else []
        copies = copies_of(self._copies)
        groups = [(futures[span.start:span.start + span.count], copies.get(span.position, 0))
                  for span in self._spans]
        self._finished = FinishedRows(groups, embed_figures,
                                      failed_at_once=sum(output is not None for output in self._outputs))

    def wait(self, timeout: float | None = None) -> bool:
        return self.submission is None or self.submission.wait(timeout)

    def finished_figures(self) -> LiveFigures:
        """The rows finished so far (provisional: `outputs()` decides; worker/hosts/finished_rows.py)."""
        return self._finished.figures()

    def abort(self) -> None:
        if self.submission is not None:
            self.submission.abort()

    def outputs(self, expired: bool = False, earlier: Sequence[OutputRow] = ()) -> list[OutputRow]:
        """Every row's outcome in input order; raises `EngineUnavailable` if the embedder died.
        `expired`: the run was aborted at the job's deadline; `earlier`: the run's earlier outcomes."""
        results: list[EmbedResult] = []
        if self.submission is not None:
            self.submission.wait()
            results = self.submission.results()
        outputs = list(self._outputs)
        for span in self._spans:
            span_results = results[span.start:span.start + span.count]
            outputs[span.position] = embedded_row(span.row, span_results, expired)
        for position, row, source in self._copies:
            outputs[position] = _copy(outputs[source], row)
        for position, row, source in self._earlier_copies:
            outputs[position] = _copy(earlier[source], row)
        return [output for output in outputs if output is not None]


def _copy(source: OutputRow | None, row: Row) -> OutputRow:
    if source is None:  # cannot happen: a copied row always ran before its copies
        raise RuntimeError(f"row {row.row_id!r} copies a row without an outcome")
    if source.failed:
        return dataclasses.replace(OutputRow.engine_failed(row, RowErrorCode(source.error_code or ""),
                                                           source.error_message or ""), deduplicated=True)
    encoding = row.embed.encoding_format if row.embed is not None else "float"
    return dataclasses.replace(source, index=row.index, row_id=row.row_id, passthrough=row.passthrough,
                               line=row.line, deduplicated=True, engine_seconds=0.0, encoding_format=encoding)


def embed_figures(results: Sequence[EmbedResult]) -> LiveFigures:
    """A finished row's figures from its inputs' results, before `embedded_row` builds it (any
    input's error fails it)."""
    if any(result.aborted or result.error is not None or result.embedding is None for result in results):
        return LiveFigures(failed=1)
    return LiveFigures(succeeded=1, prompt=sum(result.prompt_tokens for result in results),
                       engine_ms=round(sum(result.seconds for result in results) * 1000))


def embedded_row(row: Row, results: Sequence[EmbedResult], expired: bool = False) -> OutputRow:
    """The row's outcome from its inputs' results: its vectors (shortened to its `dimensions`, and
    renormalised unless it asked for `normalize: false`), or the first input's error (named by
    position when the row has several)."""
    if any(result.aborted for result in results):
        if expired:
            return expired_row(row)
        return OutputRow.engine_failed(row, RowErrorCode.ENGINE_ERROR, "aborted by the worker")
    several = len(results) > 1
    for index, result in enumerate(results):
        if result.error is not None or result.embedding is None:
            where = f"input {index}: " if several else ""
            code = RowErrorCode.PROMPT_TOO_LONG if result.too_long else RowErrorCode.INVALID_ROW
            return OutputRow.engine_failed(row, code, f"{where}{result.error or 'no vector came back'}")
    dimensions = row.embed.dimensions if row.embed is not None else None
    renormalize = row.embed is None or row.embed.normalize is not False
    try:
        vectors = [shorten(result.embedding or [], dimensions, renormalize) for result in results]
    except ValueError as error:  # dimensions past the model's size
        return OutputRow.engine_failed(row, RowErrorCode.INVALID_ROW, str(error))
    return OutputRow.embedded(row, vectors, prompt_tokens=sum(result.prompt_tokens for result in results),
                              engine_seconds=sum(result.seconds for result in results))

"""Between a job's rows and the engine, both ways: row -> engine request -> output row.

- Rows in: a row's prompt becomes token ids (`PromptRenderer`, worker/hosts/prompt_renderer.py), its
  merged sampling and `response_format` become `engine.SamplingParams` (`engine_sampling`: every job
  knob has an engine field of the same name, vLLM's; a `json_schema` format becomes the engine's
  `json_schema`, a `json_object` one `True`), and a batch of rows is readied for the engine
  (`PreparedBatch`). A row with tools, or on a thinking model, gets a `ChatPlan` as it is rendered
  (worker/tools/): its tools in the model's format, where its thinking starts, the structural tag
  that holds its output.
- Rows out: an engine `RequestOutput` becomes a job `OutputRow` (`output_row`: one choice per
  sample, logprobs in the jobs' form, thinking and calls read apart by the row's plan), and an
  engine rejection the row error its `error_kind` maps to (`ROW_CODES`: the one table between the
  engine's codes and the jobs').
- In between: `EngineRun` submits a batch to a hosted engine, waits, and collects every row's
  outcome in input order; the shard runner (`worker/hosts/row_window.py`, a window of rows at a time) and
  `bulkinfer run` both go through it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from bulkinfer.engine import ErrorKind, LoRARequest, RequestOutput, SamplingParams, SamplingParamsError
from bulkinfer.engine.multimodal.inputs import MultiModalPrompt
from bulkinfer.jobs.formats.output import (
    Choice,
    OutputRow,
    PositionLogprobs,
    PromptLogprobs,
    TokenLogprob,
    ToolCall,
    expired_row,
)
from bulkinfer.jobs.formats.rows import Row, RowError, RowErrorCode
from bulkinfer.jobs.output_tokens import DEFAULT_MAX_TOKENS_CAP, max_tokens_problem
from bulkinfer.jobs.response_format import engine_response_format
from bulkinfer.jobs.sampling import JobSampling
from bulkinfer.jobs.spec import JobSpec
from bulkinfer.jobs.state.live_progress import LiveFigures
from bulkinfer.worker.hosts.engine_host import LORA_REFUSED, EngineRequest, Submission
from bulkinfer.worker.hosts.finished_rows import FinishedRows, copies_of
from bulkinfer.worker.hosts.lora_requests import AdapterRefused
from bulkinfer.worker.hosts.prompt_renderer import (
    PromptRenderer,
    RowRejected,
)
from bulkinfer.worker.hosts.row_images import (
    ImageRowRejected,
    fetch_rows_images,
    has_images,
    image_prompt,
)
from bulkinfer.worker.images.fetcher import ImageFetcher
from bulkinfer.worker.process import metrics
from bulkinfer.worker.tools.answers import PLAIN, ChatPlan, read_answer
from bulkinfer.worker.tools.formats import (
    ToolCallsUnreadable,
)

if TYPE_CHECKING:
    from bulkinfer.worker.hosts.engine_host import EngineHost
    from bulkinfer.worker.hosts.lora_requests import AdapterRequests
    from bulkinfer.worker.hosts.model_hosts import HostedModel

ENGINE_FIELDS = frozenset(field.name for field in dataclasses.fields(SamplingParams))
# The row error code of each way the engine refuses or fails a request (engine/errors.py): the one
# table between the engine's codes and the jobs' (its messages are for people, never parsed).
ROW_CODES = {
    ErrorKind.PROMPT_TOO_LONG: RowErrorCode.PROMPT_TOO_LONG,
    ErrorKind.EMPTY_PROMPT: RowErrorCode.INVALID_ROW,
    ErrorKind.INVALID_PROMPT: RowErrorCode.INVALID_ROW,
    ErrorKind.INVALID_SAMPLING: RowErrorCode.INVALID_SAMPLING,
    ErrorKind.STRUCTURED_OUTPUT: RowErrorCode.INVALID_RESPONSE_FORMAT,  # e.g. a schema that does not compile
    ErrorKind.NON_FINITE_LOGITS: RowErrorCode.ENGINE_ERROR,
    ErrorKind.INVALID_IMAGE: RowErrorCode.INVALID_IMAGE,
    ErrorKind.ENGINE_FAILURE: RowErrorCode.ENGINE_ERROR,
}


def engine_sampling(sampling: JobSampling, response_format: dict[str, Any] | None = None,
                    max_tokens_cap: int = DEFAULT_MAX_TOKENS_CAP) -> SamplingParams:
    """The engine's params for a row's merged sampling and response_format; raises `RowRejected`.

    A row without max_tokens generates until it stops: up to `max_tokens_cap`, and the engine ends
    it at the model's context (finish_reason `length`), as OpenAI's and vLLM's chat APIs do; never
    the engine's offline default of 16 (jobs/output_tokens.py)."""
    settings = sampling.as_dict()
    unknown = sorted(set(settings) - ENGINE_FIELDS)
    if unknown:  # a job knob this engine build lacks: refused by name, never dropped
        raise RowRejected(RowErrorCode.INVALID_SAMPLING, f"{unknown[0]} is not supported by this engine")
    problem = max_tokens_problem(settings.get("max_tokens"), max_tokens_cap)
    if problem is not None:
        raise RowRejected(RowErrorCode.INVALID_SAMPLING, problem)
    settings.setdefault("max_tokens", max_tokens_cap)
    params = SamplingParams(**settings, json_schema=engine_json_schema(response_format))
    try:  # early, so the row is refused before it is rendered; the engine's own check is the same
        params.validate()
    except SamplingParamsError as error:
        raise RowRejected(engine_error_code(error.kind), str(error)) from None
    return params


def engine_json_schema(response_format: dict[str, Any] | None) -> dict[str, Any] | bool | None:
    """A row's response_format (the OpenAI wire shape `bulkinfer.jobs.response_format` gives) as the engine's
    `json_schema`: the schema dict, True for any JSON object, None for plain text."""
    if response_format is None or response_format.get("type") == "text":
        return None
    if response_format.get("type") == "json_object":
        return True
    if response_format.get("type") == "json_schema":
        return response_format["json_schema"]["schema"]
    raise RowRejected(RowErrorCode.INVALID_RESPONSE_FORMAT,
                      f"response_format type {response_format.get('type')!r} is not supported")


def job_response_format_problem(spec: JobSpec) -> str | None:
    """Why the job's own response_format can never compile, as `response_format: <reason>` (checked
    once, without a model, at plan and before `bulkinfer run`), or None. Rows' own formats are
    still checked by the engine, row by row."""
    try:
        schema = engine_json_schema(engine_response_format(spec.response_format))
    except RowRejected as rejected:
        return f"response_format: {rejected}"
    if schema is None:
        return None
    from bulkinfer.engine.structured_output import StructuredSpec, check_spec  # xgrammar: only when used

    try:
        check_spec(StructuredSpec.json_schema(schema))
    except ValueError as error:  # GrammarError, or a schema that is not a dict
        return f"response_format: {error}"
    return None


def engine_error_code(kind: ErrorKind | str | None) -> RowErrorCode:
    """The row error code for an engine rejection or failure, from its `error_kind`."""
    if kind == LORA_REFUSED:
        return RowErrorCode.INVALID_LORA
    try:
        return ROW_CODES[ErrorKind(kind)] if kind is not None else RowErrorCode.ENGINE_ERROR
    except (ValueError, KeyError):  # a kind this worker does not know yet
        return RowErrorCode.ENGINE_ERROR


FAILED = ("error", "abort")
# Distinct deterministic rows one run (a shard) remembers for deduplication (~120 B each); rows past
# it still run, only without being merged with later identical ones.
MAX_REMEMBERED_REQUESTS = 200_000


@dataclass(frozen=True)
class PreparedRow:
    position: int  # in the batch's input order
    row: Row
    request: EngineRequest
    prompt_format: str  # how its prompt was rendered (PromptRenderer.prompt_format)
    plan: ChatPlan = PLAIN  # how its output is held and read (tools, thinking)


def deterministic(params: SamplingParams) -> bool:
    """Whether a request gives the same output every time it runs: greedy, or an explicit seed."""
    return params.temperature == 0 or params.seed is not None


def request_key(request: EngineRequest) -> str:
    """Two requests with the same key compute the same output (when `deterministic`)."""
    params = json.dumps(dataclasses.asdict(request.params), sort_keys=True, default=repr)
    lora = request.lora_request
    # An image's tokens are the same whatever the picture: its content digest tells rows apart.
    images = request.prompt.items if isinstance(request.prompt, MultiModalPrompt) else ()
    pictures = "".join(f"|image:{item.digest}@{item.offset}" for item in images)
    return f"{prompt_token_ids_of(request)!r}{pictures}|{params}" + \
        (f"|lora:{lora.lora_name}" if lora is not None else "")


def prompt_token_ids_of(request: EngineRequest) -> list[int]:
    """The request's prompt tokens (its text's characters for a text prompt: an ordering key)."""
    prompt = request.prompt
    if isinstance(prompt, MultiModalPrompt):
        return prompt.token_ids
    return [ord(c) for c in prompt] if isinstance(prompt, str) else list(prompt)


def request_digest(request: EngineRequest) -> bytes:
    """`request_key` in 16 bytes: what a run remembers per distinct row."""
    return hashlib.sha256(request_key(request).encode("utf-8", "surrogatepass")).digest()[:16]


def row_adapter(row: Row, adapters: AdapterRequests | None) -> LoRARequest | None:
    """The row's LoRA adapter for the engine (None: the base); raises `AdapterRefused`."""
    if row.lora is None:
        return None
    if adapters is None:
        raise AdapterRefused(RowErrorCode.INVALID_LORA, "this model is hosted without LoRA adapters")
    return adapters.for_row(row)


class PreparedBatch:
    """A batch of rows readied for the engine: the outcomes of rows that cannot run (a read error, a
    rejected sampling or prompt), and a request for each of the rest.

    With `deduplicate`, rows whose rendered prompt and sampling are identical and deterministic
    (greedy or seeded) share one request: the first such row runs, every later one gets its output
    under its own id and passthrough columns (`OutputRow.deduplicated`). Rows sampled at random
    without a seed always run on their own.
    """

    def __init__(self, renderer: PromptRenderer, items: Sequence[Row | RowError], priority: int = 0,
                 deduplicate: bool = True, known: dict[bytes, int] | None = None, offset: int = 0,
                 cache_salt: str | None = None, adapters: AdapterRequests | None = None,
                 max_tokens_cap: int = DEFAULT_MAX_TOKENS_CAP, images: ImageFetcher | None = None) -> None:
        """`images`: reads the rows' images (the job's limits and location rules)."""
        self._outputs: list[OutputRow | None] = [None] * len(items)
        self._renderer = renderer
        prepared: list[PreparedRow] = []
        self._copies: list[tuple[int, Row, int]] = []  # (position, row, position of the row it copies)
        # Rows copying a row of an earlier batch of the same run: (position, row, that row's run position).
        self._earlier_copies: list[tuple[int, Row, int]] = []
        # request digest -> run position of the row that runs it; shared by a run's batches (`offset`:
        # this batch's first run position), so a row identical to one of an earlier batch runs once too.
        first_of = {} if known is None else known
        # The rows' images are read together first (worker/hosts/row_images.py), then expanded row by row.
        image_chats = {position: chat for position, item in enumerate(items) if isinstance(item, Row)
                       and has_images(chat := renderer.chat_messages(item))}
        fetched = fetch_rows_images(image_chats, images if renderer.image_family is not None else None)
        for position, item in enumerate(items):
            if isinstance(item, RowError):
                self._outputs[position] = OutputRow.from_error(item)
                continue
            try:
                params = engine_sampling(item.sampling, item.response_format, max_tokens_cap)
                lora = row_adapter(item, adapters)
                token_ids, plan = renderer.prepare(item)
                prompt: list[int] | MultiModalPrompt = token_ids
                if position in image_chats:
                    prompt = image_prompt(token_ids, fetched.get(position), renderer.image_family,
                                          renderer.model)
                request = EngineRequest(prompt, plan.sampling(params), priority, cache_salt, lora)
            except (RowRejected, AdapterRefused, ImageRowRejected) as rejected:
                self._outputs[position] = OutputRow.engine_failed(item, rejected.code, str(rejected))
                continue
            if deduplicate and deterministic(params):
                digest = request_digest(request)
                source = first_of.get(digest)
                if source is not None and source >= offset:
                    self._copies.append((position, item, source - offset))
                    continue
                if source is not None:
                    self._earlier_copies.append((position, item, source))
                    continue
                if len(first_of) < MAX_REMEMBERED_REQUESTS:
                    first_of[digest] = offset + position
            prepared.append(PreparedRow(position, item, request, renderer.prompt_format(item), plan))
        # Rows sharing a prefix enter the engine together, so later ones hit the prefix cache.
        prepared.sort(key=lambda entry: prompt_token_ids_of(entry.request))
        self._prepared = prepared

    @property
    def requests(self) -> list[EngineRequest]:
        """What to submit, in the order `outputs` takes the results back."""
        return [entry.request for entry in self._prepared]

    def finished_rows(self, futures: Sequence[Future]) -> FinishedRows:
        """Counts the batch's rows as `futures` (its `requests`', in that order) finish."""
        copies = copies_of(self._copies)
        groups = [([future], copies.get(entry.position, 0)) for entry, future in zip(self._prepared, futures,
                                                                                       strict=True)]
        return FinishedRows(groups, request_figures,
                            failed_at_once=sum(output is not None for output in self._outputs))

    def outputs(self, results: Sequence[RequestOutput], expired: bool = False,
                earlier: Sequence[OutputRow] = ()) -> list[OutputRow]:
        """Every row's outcome in input order, given the engine's results for `requests`
        (`expired`: the rows were aborted because the job's deadline passed; `earlier`: the
        outcomes of the run's earlier batches, by run position, for rows that copy one of them)."""
        outputs = list(self._outputs)
        result_at: dict[int, RequestOutput] = {}
        lora_at: dict[int, str | None] = {}
        entry_at: dict[int, PreparedRow] = {}
        for entry, result in zip(self._prepared, results, strict=True):
            lora = entry.request.lora_request.lora_name if entry.request.lora_request is not None else None
            outputs[entry.position] = output_row(entry.row, result, expired, self._renderer, lora,
                                                 entry.prompt_format, entry.plan)
            result_at[entry.position], lora_at[entry.position] = result, lora
            entry_at[entry.position] = entry
        for position, row, source in self._copies:
            # The copy's own plan: whether its thinking is shown is its request's (an Anthropic
            # request that did not ask may share a prompt with one that did).
            plan = dataclasses.replace(entry_at[source].plan, hide_reasoning=row.hide_reasoning)
            copy = output_row(row, result_at[source], expired, self._renderer, lora_at[source],
                              entry_at[source].prompt_format, plan)
            outputs[position] = dataclasses.replace(copy, deduplicated=True, engine_seconds=0.0,
                                                    drafted_per_position=(), accepted_per_position=())
        for position, row, source in self._earlier_copies:
            outputs[position] = dataclasses.replace(earlier[source], index=row.index, row_id=row.row_id,
                                                    passthrough=row.passthrough, line=row.line,
                                                    echo_prompt=row.prompt if row.echo else None,
                                                    choices=_choices_for(row, earlier[source].choices),
                                                    deduplicated=True, engine_seconds=0.0,
                                                    drafted_per_position=(), accepted_per_position=())
        return [output for output in outputs if output is not None]


def output_row(row: Row, result: RequestOutput, expired: bool = False,
               renderer: PromptRenderer | None = None, lora: str | None = None,
               prompt_format: str | None = None, plan: ChatPlan = PLAIN) -> OutputRow:
    """The row's outcome: every sample as a choice, or the engine's error when any sample failed
    (a grammar that does not compile fails them all; an aborted request aborts them all, and is
    `expired` when the job's deadline aborted it). `renderer` names the first prompt token of a
    row that scored its prompt; `lora`: the adapter it ran on, for its usage; `prompt_format`: how
    its prompt was rendered; `plan`: how its thinking and calls are read from its text."""
    outputs = list(getattr(result, "outputs", None) or [])
    reasons = [result.finish_reason, *(output.finish_reason for output in outputs)]
    failed = next((reason for reason in reasons if reason in FAILED), None)
    if failed == "abort" and expired:
        return expired_row(row)
    if failed is not None:
        message = result.error or ("aborted by the worker" if failed == "abort" else "the engine failed")
        return OutputRow.engine_failed(row, engine_error_code(result.error_kind), message)
    if outputs:
        choices = [Choice(out.index, out.text, out.finish_reason or "stop", _logprobs(out.logprobs),
                          stop_reason=out.stop_reason)
                   for out in sorted(outputs, key=lambda out: out.index)]
    else:  # an engine that reports one sample only on the request itself
        choices = [Choice(0, result.text, result.finish_reason or "stop")]
    reasoning_tokens, problem = 0, None
    if plan.reads_output and renderer is not None:
        token_ids = {out.index: out.token_ids for out in outputs} or {0: result.token_ids}
        choices, reasoning_tokens, problem = _read_choices(row, choices, token_ids, plan, renderer)
    metrics_ = getattr(result, "metrics", None)
    drafted = tuple(getattr(metrics_, "spec_drafted_per_position", ()))
    accepted = tuple(getattr(metrics_, "spec_accepted_per_position", ()))
    completed = OutputRow.with_choices(row, choices, prompt_tokens=result.num_prompt_tokens,
                                       cached_tokens=result.num_cached_tokens,
                                       completion_tokens=result.num_completion_tokens,
                                       engine_seconds=getattr(metrics_, "engine_seconds", 0.0) or 0.0,
                                       drafted_per_position=drafted, accepted_per_position=accepted,
                                       prompt_logprobs=_prompt_logprobs(result, renderer))
    completed = dataclasses.replace(completed, lora=lora, prompt_format=prompt_format,
                                    reasoning_tokens=reasoning_tokens)
    if problem is not None and not completed.failed:
        completed = dataclasses.replace(completed, error_code=RowErrorCode.INVALID_OUTPUT_JSON.value,
                                        error_message=problem)
    return completed


def _read_choices(row: Row, choices: list[Choice], token_ids: dict[int, list[int]], plan: ChatPlan,
                  renderer: PromptRenderer) -> tuple[list[Choice], int, str | None]:
    """Each sample's thinking and calls read apart (worker/tools/answers.py): the choices, the
    thinking's tokens over all samples, and the first sample's problem (a call cut off)."""
    read, spent, problem = [], 0, None
    for choice in choices:
        try:
            answer = read_answer(plan, choice.text, token_ids.get(choice.index, []), renderer.decode,
                                 cut=choice.finish_reason == "length")
        except ToolCallsUnreadable as error:
            where = f"choice {choice.index}: " if len(choices) > 1 else ""
            problem = problem or f"{where}{error} (finish_reason={choice.finish_reason})"
            read.append(choice)
            continue
        spent += answer.reasoning_tokens
        calls = tuple(ToolCall(call_id(row.row_id, choice.index, number), call.name, call.arguments)
                      for number, call in enumerate(answer.calls))
        finish = "tool_calls" if calls and choice.finish_reason == "stop" else choice.finish_reason
        read.append(dataclasses.replace(choice, text=answer.text, reasoning=answer.reasoning,
                                        tool_calls=calls, finish_reason=finish))
    return read, spent, problem


def _choices_for(row: Row, choices: tuple[Choice, ...]) -> tuple[Choice, ...]:
    """Another row's samples as this row's: its own call ids, and its thinking only where it asked."""
    return tuple(dataclasses.replace(
        choice, reasoning=None if row.hide_reasoning else choice.reasoning,
        tool_calls=tuple(dataclasses.replace(call, id=call_id(row.row_id, choice.index, number))
                         for number, call in enumerate(choice.tool_calls))) for choice in choices)


def call_id(row_id: str, choice: int, number: int) -> str:
    """A call's id: stable for the row (a rerun writes the same), distinct per sample and call."""
    digest = hashlib.sha256(f"{row_id}\x00{choice}\x00{number}".encode("utf-8", "surrogatepass")).hexdigest()
    return f"call_{digest[:24]}"


def request_figures(results: Sequence[RequestOutput]) -> LiveFigures:
    """A finished row's figures from its one request's result, before `output_row` builds it:
    failed as `output_row` fails it (any sample failed), with the tokens a completed row reports."""
    result = results[0]
    samples = getattr(result, "outputs", None) or []
    if any(reason in FAILED for reason in [result.finish_reason, *(out.finish_reason for out in samples)]):
        return LiveFigures(failed=1)
    engine_seconds = getattr(getattr(result, "metrics", None), "engine_seconds", 0.0) or 0.0
    return LiveFigures(succeeded=1, prompt=result.num_prompt_tokens or 0,
                       cached=result.num_cached_tokens or 0, completion=result.num_completion_tokens or 0,
                       engine_ms=round(engine_seconds * 1000))


def _prompt_logprobs(result: RequestOutput, renderer: PromptRenderer | None) -> PromptLogprobs | None:
    scored = getattr(result, "prompt_logprobs", None)
    if scored is None or not result.prompt_token_ids:
        return None
    first = result.prompt_token_ids[0]
    text, raw = renderer.token_text(first) if renderer is not None else ("", [])
    return PromptLogprobs(first, text, raw, _logprobs(scored[1:]) or [])


def _logprobs(positions: Sequence | None) -> list[PositionLogprobs] | None:
    if positions is None:
        return None
    return [PositionLogprobs(_token(position.chosen), [_token(entry) for entry in position.top])
            for position in positions]


def _token(entry) -> TokenLogprob:  # noqa: ANN001 - bulkinfer.engine.outputs.TokenLogprob
    return TokenLogprob(entry.token_id, entry.token, float(entry.logprob), list(entry.bytes))


class EngineRun:
    """A batch of rows in a hosted engine: readied as `PreparedBatch` readies rows, the runnable
    ones submitted at once; `outputs()` gives every row's outcome in input order when done."""

    def __init__(self, hosted: HostedModel, items: Sequence[Row | RowError], priority: int = 0,
                 deduplicate: bool = True, known: dict[bytes, int] | None = None, offset: int = 0,
                 cache_salt: str | None = None, images: ImageFetcher | None = None) -> None:
        self._prepared = PreparedBatch(hosted.renderer, items, priority, deduplicate, known, offset,
                                       cache_salt=cache_salt, adapters=hosted.adapters,
                                       max_tokens_cap=hosted.max_tokens_cap, images=images)
        self.rows = len(items)
        self._model = hosted.name
        requests = self._prepared.requests
        host = cast("EngineHost", hosted.host)  # a text model's rows: HostedModel gave it an engine
        self.submission: Submission | None = host.submit(requests) if requests else None
        self._finished = self._prepared.finished_rows(self.submission.futures if self.submission else [])

    def wait(self, timeout: float | None = None) -> bool:
        """True once the engine is done with every row (at once when none could run)."""
        return self.submission is None or self.submission.wait(timeout)

    def finished_figures(self) -> LiveFigures:
        """The rows finished so far (provisional: `outputs()` decides; worker/hosts/finished_rows.py)."""
        return self._finished.figures()

    def outputs(self, expired: bool = False, earlier: Sequence[OutputRow] = ()) -> list[OutputRow]:
        """Every row's outcome in input order; raises `EngineUnavailable` if the engine died.
        `expired`: the run was aborted at the job's deadline (aborted rows become `expired`);
        `earlier`: the outcomes of the batches before this one (see `PreparedBatch.outputs`)."""
        if self.submission is None:
            return self._prepared.outputs([], earlier=earlier)
        self.submission.wait()
        results = self.submission.results()
        metrics.record_requests(self._model, results)
        return self._prepared.outputs(results, expired, earlier)

    def abort(self) -> None:
        """Stop every row still in the engine (their outcomes say so)."""
        if self.submission is not None:
            self.submission.abort()

"""Anthropic's Message Batches API over our jobs.

A batch's requests arrive inline; each becomes a line `{custom_id, method, url: "/v1/messages",
body: params}` of the job's input (OpenAI-batch JSONL, the format whose row builder reads Messages
bodies: jobs/formats/anthropic_messages.py), so a request we cannot serve (server tools, documents, another
model) is that request's `errored` result and never fails the batch. The job runs one model: the
first request's (a name in `model_aliases` counts as the model it names, a LoRA adapter's as the
model it is registered on); a request naming an adapter of it runs on that adapter.

Results are the job's output lines in Anthropic's shape (jobs/formats/anthropic_results.py), plus
`canceled` for each request a cancelled batch never ran. Anthropic keeps a batch 24 hours: that is
the job's completion window, and a request not done by then is `expired`.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import IO, Any, NamedTuple

from bulkinfer.api.auth import Caller
from bulkinfer.api.dependencies import ApiContext
from bulkinfer.api.errors import HttpError
from bulkinfer.api.json_body import MAX_JSON_DEPTH
from bulkinfer.api.json_pieces import COMPACT_JSON, json_pieces
from bulkinfer.api.json_stream import JsonBodyProblem, iter_array_items
from bulkinfer.api.submission import check_in_flight, create_and_enqueue, validate_input
from bulkinfer.api.v1.batch_records import BatchRecord, BatchRecords, batch_id_for, new_job_id
from bulkinfer.api.v1.files import owner_of
from bulkinfer.api.v1.job_outputs import output_records
from bulkinfer.jobs.formats.anthropic_results import anthropic_result, canceled_result
from bulkinfer.jobs.formats.lines import iter_lines_in_range
from bulkinfer.jobs.model_registry import UnknownModel
from bulkinfer.jobs.object_store.base import AlreadyExists, ObjectNotFound, ObjectWriter
from bulkinfer.jobs.spec import InputFormat, JobSpec, JobTask
from bulkinfer.jobs.state.status import JobState, JobStatus

MESSAGES_URL = "/v1/messages"
WINDOW = "24h"
MAX_REQUESTS = 100_000
MAX_VALUES_PER_REQUEST = 100_000  # JSON values in one request's params: far past any real conversation
MAX_MODEL_CHARS = 256
WRITE_BYTES = 1 << 20  # the job's input handed to the store about a MiB at a time
LONG_TEXT_CHARS = 1 << 20  # a request holding a longer string is written piece by piece
CUSTOM_ID = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
INPUT_NAME = "requests.jsonl"
COUNTS_NAME = "anthropic_counts.json"
COUNT_NAMES = ("processing", "succeeded", "errored", "canceled", "expired")


def create_batch(context: ApiContext, caller: Caller, body: IO[bytes]) -> dict[str, Any]:
    """The batch of the JSON body in `body` (a file: the request as received), read a request at a
    time: each is checked and written as a line of the job's input as it is read."""
    job_id = new_job_id()
    store = context.store
    input_key = context.repository.layout(job_id).input_key(INPUT_NAME)
    with store.open_write(input_key) as writer:  # an exception aborts it: nothing half-written stays
        written = _write_input(context, _requests(body), writer)
    spec = JobSpec(input_uri=store.uri(input_key), input_format=InputFormat.OPENAI_BATCH,
                   output_format=InputFormat.OPENAI_BATCH, model=written.model, tenant=caller.tenant,
                   completion_window=WINDOW, task=JobTask.GENERATE)  # given: no line is read again
    try:
        check_in_flight(context, spec, job_id)
        spec = validate_input(context, spec, store, input_key)
    except Exception:
        store.delete(input_key)
        raise
    status = create_and_enqueue(context, spec, job_id)
    record = BatchRecord(id=batch_id_for("anthropic", job_id), api="anthropic", owner=owner_of(caller),
                         created_at=int(time.time()), job_id=job_id, model=written.model,
                         requests=written.requests, completion_window=WINDOW)
    BatchRecords(context, "anthropic").put(record)
    return batch_object(context, record, "", status)


@dataclass(frozen=True)
class _Written:
    model: str
    requests: int


class _Request(NamedTuple):
    custom_id: str
    params: dict[str, Any]
    longest_text: int


def _requests(body: IO[bytes]) -> Iterator[_Request]:
    """(custom_id, params) of each request, read one at a time; 400 naming the first that is not
    `{custom_id, params}` (unique ids) or the body's problem."""
    first_index: dict[str, int] = {}
    # The whole body's depth limit, as the small bodies have (the body's object and array are 2).
    items = iter_array_items(body, "requests", max_items=MAX_REQUESTS, max_depth=MAX_JSON_DEPTH - 2,
                             max_values_per_item=MAX_VALUES_PER_REQUEST)
    try:
        for index, (request, longest_text) in enumerate(items):
            custom_id, params = _checked(request, f"requests.{index}", first_index)
            del request  # held only by the caller from here: gone once it has written the line
            yield _Request(custom_id, params, longest_text)
            del params
            first_index[custom_id] = index
    except JsonBodyProblem as problem:
        raise HttpError(400, str(problem)) from None
    if not first_index:
        raise HttpError(400, f"requests: give 1 to {MAX_REQUESTS:,} requests, not 0")


def _checked(request: object, where: str, first_index: dict[str, int]) -> tuple[str, dict[str, Any]]:
    if not isinstance(request, dict) or set(request) - {"custom_id", "params"}:
        raise HttpError(400, f"{where}: must be an object with exactly custom_id and params")
    custom_id = request.get("custom_id")
    if not isinstance(custom_id, str) or not CUSTOM_ID.match(custom_id):
        raise HttpError(400, f"{where}.custom_id: 1 to 64 letters, digits, '_' or '-'")
    if custom_id in first_index:
        raise HttpError(400, f"{where}.custom_id: {custom_id!r} is also the custom_id of requests."
                             f"{first_index[custom_id]}; each request needs its own")
    params = request.get("params")
    if not isinstance(params, dict) or not isinstance(params.get("model"), str):
        raise HttpError(400, f"{where}.params: an object with a model is required")
    if len(params["model"]) > MAX_MODEL_CHARS:
        raise HttpError(400, f"{where}.params.model: at most {MAX_MODEL_CHARS} characters, not "
                             f"{len(params['model']):,}")
    return custom_id, params


def _write_input(context: ApiContext, requests: Iterator[_Request],
                 writer: ObjectWriter) -> _Written:
    """Each request as a line of the job's input (a MiB at a time); the batch's model is the served
    model of the first request whose model is served (or an alias of one, or a LoRA adapter
    registered on one)."""
    model: str | None = None
    first_named: str | None = None
    count = 0
    pending = bytearray()
    for custom_id, params, longest_text in requests:
        count += 1
        first_named = first_named or params["model"]
        if model is None:
            try:
                model = context.registry.resolve_requested(params["model"])[0]
            except UnknownModel:
                pass  # an earlier or later request may name one: this one is its own error at run time
        line = _input_line(context, custom_id, params, model)
        del params
        if longest_text < LONG_TEXT_CHARS:
            pending += COMPACT_JSON.encode(line).encode() + b"\n"
            if len(pending) >= WRITE_BYTES:
                writer.write(bytes(pending))
                pending.clear()
            continue
        # A request with a very long text: written a piece at a time, each long string from its
        # UTF-8 bytes (api/json_pieces.py), and gone before the next request is read.
        writer.write(bytes(pending))
        pending.clear()
        for piece in json_pieces(line, LONG_TEXT_CHARS):
            writer.write(piece)
        writer.write(b"\n")
        del line
    writer.write(bytes(pending))
    if model is None:  # 400 naming the served models and the aliases, and how to add one
        raise UnknownModel(first_named or "", context.registry.names(), context.registry.aliases())
    return _Written(model=model, requests=count)


def _input_line(context: ApiContext, custom_id: str, params: dict[str, Any],
                model: str | None) -> dict[str, Any]:
    if model is not None:
        try:  # an alias of the batch's model becomes its name, so the row builder sees the model it
            base, adapter = context.registry.resolve_requested(params["model"])  # is; any other name stays
            if adapter is None and base == model:
                params = {**params, "model": base}
        except UnknownModel:
            pass  # the worker makes any name it cannot run this request's error, naming what it is
    return {"custom_id": custom_id, "method": "POST", "url": MESSAGES_URL, "body": params}


# -- the batch object -----------------------------------------------------------------------------


def batch_object(context: ApiContext, record: BatchRecord, base_url: str, status: JobStatus | None = None,
                 canceling: bool = False) -> dict[str, Any]:
    """The SDK's `MessageBatch`, its state read from the job."""
    status = status or context.repository.get(str(record.job_id))
    ended = status.state.is_terminal and not canceling
    cancelled = status.state == JobState.CANCELLED
    return {
        "id": record.id, "type": "message_batch",
        "processing_status": "ended" if ended else "canceling" if cancelled else "in_progress",
        "request_counts": _counts(context, record, status, ended),
        "ended_at": _rfc3339(status.finished_at) if ended else None,
        "created_at": _rfc3339(datetime.fromtimestamp(record.created_at, UTC)),
        "expires_at": _rfc3339(status.expires_at), "archived_at": None,
        "cancel_initiated_at": _rfc3339(status.finished_at) if cancelled else None,
        "results_url": f"{base_url}v1/messages/batches/{record.id}/results" if ended else None}


def _rfc3339(moment: datetime | None) -> str | None:
    return None if moment is None else moment.astimezone(UTC).isoformat().replace("+00:00", "Z")


def _counts(context: ApiContext, record: BatchRecord, status: JobStatus, ended: bool) -> dict[str, int]:
    """Live counts while the batch runs; once it has ended, each result's type counted (once: kept
    in the job's folder)."""
    if not ended:
        done = status.rows.succeeded + status.rows.failed
        return {"processing": max(0, record.requests - done), "succeeded": status.rows.succeeded,
                "errored": status.rows.failed, "canceled": 0, "expired": 0}
    key = f"{context.repository.layout(status.job_id).job_dir}/{COUNTS_NAME}"
    try:
        return json.loads(context.store.get_bytes(key))
    except ObjectNotFound:
        pass
    counts = dict.fromkeys(COUNT_NAMES, 0)
    for line in results(context, record, status):
        result_type = line["result"]["type"]
        counts["errored" if result_type == "errored" else result_type] += 1
    try:
        context.store.put_bytes(key, json.dumps(counts).encode(), if_none_match=True)
    except AlreadyExists:
        pass
    return counts


# -- results --------------------------------------------------------------------------------------


def results(context: ApiContext, record: BatchRecord, status: JobStatus) -> Iterator[dict[str, Any]]:
    """One result per request: the job's output rows, then `canceled` for each request it never ran."""
    seen: set[str] = set()
    for _data, output in output_records(context, status):
        seen.add(output["custom_id"])
        yield anthropic_result(output, record.model or "")
    if len(seen) < record.requests:
        input_key = context.repository.layout(status.job_id).input_key(INPUT_NAME)
        for line in iter_lines_in_range(context.store, input_key, 0, context.store.head(input_key).size):
            custom_id = json.loads(line.data)["custom_id"]
            if custom_id in seen:
                continue
            if status.state == JobState.CANCELLED:
                yield canceled_result(custom_id)
            else:  # the job failed before this request ran: say why
                failed = {"custom_id": custom_id, "response": None,
                          "error": {"code": "job_failed", "message": status.error or "the batch failed"}}
                yield anthropic_result(failed, record.model or "")


def result_lines(context: ApiContext, record: BatchRecord, status: JobStatus) -> Iterator[bytes]:
    for result in results(context, record, status):
        yield (json.dumps(result, ensure_ascii=False, separators=(",", ":")) + "\n").encode()

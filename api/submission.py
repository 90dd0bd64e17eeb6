"""Checks at submit, so a job that cannot run is refused with a message instead of failing later.

Only the head of the input is read: the first lines of JSONL, or a Parquet file's footer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from api.dependencies import ApiContext
from api.dispatch import enqueue_plan
from api.errors import HttpError, invalid_model
from api.estimate import estimate_spec
from api.storage_rules import check_allowed, claim_output_folder
from jobs.deadlines import window_seconds
from jobs.errors import InputError
from jobs.estimate_report import JobEstimate
from jobs.formats.detect import resolve_spec
from jobs.formats.lines import iter_lines_in_range
from jobs.layout import jobs_root
from jobs.object_store.base import ObjectNotFound, ObjectStore
from jobs.object_store.factory import split_uri
from jobs.repository import JobNotFound, JobRepository
from jobs.sharding import open_parquet
from jobs.spec import SERVER_SET_FIELDS, InputFormat, JobSpec, server_set_problems
from jobs.status import JobState, JobStatus
from jobs.webhooks import destination_problem

M = TypeVar("M", bound=BaseModel)

HEAD_ROWS = 5
HEAD_BYTES = 1 << 20


def locate(context: ApiContext, uri: str, field: str) -> tuple[ObjectStore, str]:
    """The store and key of a spec's URI. Local paths must lie in a local job store: that is what
    the workers can read (elsewhere, upload the file instead).
    """
    scheme, bucket, key = split_uri(uri)
    if scheme == "s3":
        return context.s3_store(bucket), key
    settings = context.settings
    if not settings.is_local_store:
        raise HttpError(400, f"{field} {uri!r} is a local path, but this deployment keeps jobs in "
                            f"{settings.store_uri}; use an s3:// URI or upload the file")
    root = settings.local_store_root()
    path = Path("/", key).resolve()
    if path != root and root not in path.parents:
        raise HttpError(400, f"{field} {uri!r} is outside the store directory {root}; "
                            "put the file there, or upload it")
    from jobs.object_store.local import LocalObjectStore

    return LocalObjectStore("/"), path.as_posix().lstrip("/")


def check_model(context: ApiContext, spec: JobSpec) -> None:
    context.registry.location(spec.model)  # UnknownModel → 400 naming the served models


def check_readable(store: ObjectStore, key: str, uri: str) -> None:
    try:
        info = store.head(key)
    except ObjectNotFound:
        raise HttpError(400, f"input_uri {uri}: no such object") from None
    except Exception as error:  # noqa: BLE001 - S3 says why (no bucket, denied, unreachable)
        raise HttpError(400, f"input_uri {uri}: cannot read it ({error})") from None
    if info.size == 0:
        raise HttpError(400, f"input_uri {uri}: the file is empty")


def head_records(store: ObjectStore, key: str) -> list[dict[str, object]]:
    """The first rows of a JSONL file that are JSON objects (bad lines are row errors later)."""
    records: list[dict[str, object]] = []
    for line in iter_lines_in_range(store, key, 0, HEAD_BYTES):
        if len(records) == HEAD_ROWS:
            break
        try:
            record = json.loads(line.data)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def check_columns(spec: JobSpec, store: ObjectStore, key: str, uri: str) -> None:
    """A column the spec needs that the head does not have at all is a spec mistake: refuse it.
    (A column only some rows lack makes those rows fail, not the job.)
    """
    required = spec.required_columns()
    if not required or spec.input_format == InputFormat.OPENAI_BATCH:
        return
    if spec.input_format == InputFormat.PARQUET:
        with open_parquet(store, key) as parquet:
            names = parquet.schema_arrow.names
        for column in required:
            if column not in names:
                raise InputError(f"column {column!r} is not in {uri} (its columns: {', '.join(names)})")
        return
    records = head_records(store, key)
    if not records:
        return
    for column in required:
        if all(column not in record for record in records):
            seen = sorted({name for record in records for name in record})
            raise InputError(f"column {column!r} is in none of the first {len(records)} rows of {uri} "
                             f"(their columns: {', '.join(seen)})")


def check_webhook(context: ApiContext, url: str | None) -> None:
    """A webhook_url this deployment may call (https, not an address of this network, unless the
    settings allow it); 400 naming the rule otherwise. Names are checked again when delivering."""
    if url is None:
        return
    settings = context.settings
    problem = destination_problem(url, allow_http=settings.webhook_allow_http,
                                  allow_private=settings.webhook_allow_private)
    if problem is not None:
        raise HttpError(400, problem)


def check_completion_window(context: ApiContext, spec: JobSpec) -> None:
    """422 for a completion_window longer than the deployment's max_completion_window."""
    window = spec.completion_window_s
    limit = context.settings.max_completion_window
    if window is not None and window > window_seconds(limit):
        raise HttpError(422, f"invalid job spec: completion_window: {spec.completion_window!r} is longer "
                             f"than this deployment's max_completion_window ({limit})")


def validate_input(context: ApiContext, spec: JobSpec, store: ObjectStore, key: str) -> JobSpec:
    """The spec resolved against its input (format detected, columns checked): what job.json holds."""
    check_webhook(context, spec.webhook_url)
    check_completion_window(context, spec)
    check_readable(store, key, spec.input_uri)
    try:
        resolved = resolve_spec(spec, store, key)
    except ValidationError as error:
        raise invalid_model(error) from None
    check_columns(resolved, store, key, spec.input_uri)
    if resolved.output_uri:
        check_allowed(context.settings.tenant_prefixes, resolved.tenant, resolved.output_uri, "output_uri")
        output_store, output_key = locate(context, resolved.output_uri, "output_uri")
        if _in_job_folders(context, output_store, output_key):
            raise HttpError(403, f"output_uri {resolved.output_uri!r} is inside the job store's jobs/ "
                                 "folder, where each job keeps its own files; leave output_uri out to write "
                                 "there")
    return resolved


def _in_job_folders(context: ApiContext, store: ObjectStore, key: str) -> bool:
    settings = context.settings
    if settings.is_local_store:
        path = Path("/", key)
        jobs = settings.local_store_root() / "jobs"
        return path == jobs or jobs in path.parents
    return store.uri("") == context.store.uri("") and (key.rstrip("/") + "/").startswith(
        jobs_root(context.repository.prefix))


def claim_output(context: ApiContext, spec: JobSpec, job_id: str) -> None:
    """An output_uri folder holds one job's parts: claim it for this job (409 if another has it)."""
    if spec.output_uri:
        store, key = locate(context, spec.output_uri, "output_uri")
        claim_output_folder(store, key, spec.output_uri, job_id,
                            may_name=lambda owner: _same_tenant(context, spec.tenant, owner))


def _same_tenant(context: ApiContext, tenant: str | None, job_id: str) -> bool:
    """Whether a caller of `tenant` may see the job (None: an admin or an open API, who see all)."""
    if tenant is None:
        return True
    try:
        return context.repository.get(job_id).tenant == tenant
    except (JobNotFound, ValueError):  # a claim whose job was never created, or not a job id at all
        return False


def create_and_enqueue(context: ApiContext, spec: JobSpec, job_id: str | None = None) -> JobStatus:
    """Create the job and ask the control queue to plan it. A job found again by its idempotency
    key is planned again only if it is still queued (a first submit that never reached the broker).
    """
    status = context.repository.create(spec, job_id=job_id)
    if status.state == JobState.QUEUED:
        try:
            enqueue_plan(context.tasks, status.job_id)
        except Exception as error:  # noqa: BLE001 - the broker is down: say so, the job waits
            raise HttpError(503, f"job {status.job_id} was created but could not be queued ({error}); "
                                "submit it again with the same idempotency_key") from None
    return status


def parse_object(data: object, model: type[M], what: str) -> M:
    """A JSON body as `model`; else 422 `invalid <what>: ...` with one message per field."""
    if not isinstance(data, dict):
        raise HttpError(422, f"the {what} must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise invalid_model(error, what) from None


def parse_spec(data: object) -> JobSpec:
    """A user's spec (a JSON submit, a dry run, an upload's spec field): 422 naming a field only the
    server sets (jobs/spec.py's `check_user_spec`, which schedule templates go through too)."""
    spec = parse_object(data, JobSpec, "job spec")
    problems = server_set_problems(spec.model_dump(include=set(SERVER_SET_FIELDS)))
    if problems:
        raise HttpError(422, "invalid job spec: " + "; ".join(problems), problems)
    return spec


def submit_spec(context: ApiContext, spec: JobSpec) -> JobStatus | JobEstimate:
    """A JSON submit: the input is already in S3 or the local store. A dry run stops after the
    checks with an estimate."""
    check_model(context, spec)
    check_allowed(context.settings.tenant_prefixes, spec.tenant, spec.input_uri, "input_uri")
    store, key = locate(context, spec.input_uri, "input_uri")
    resolved = validate_input(context, spec, store, key)
    if resolved.dry_run:
        return estimate_spec(context, resolved, store, key)
    job_id = JobRepository.job_id_for(resolved)
    check_in_flight(context, resolved, job_id)
    claim_output(context, resolved, job_id)
    return create_and_enqueue(context, resolved, job_id)


ACTIVE_STATES = (JobState.QUEUED, JobState.RUNNING, JobState.FINALIZING)


def check_in_flight(context: ApiContext, spec: JobSpec, job_id: str) -> None:
    """429 when the tenant already has `max_jobs_in_flight` jobs not yet ended (a submit that finds
    its own job again, by its idempotency key, is never refused)."""
    limit = context.settings.max_jobs_in_flight
    repository = context.repository
    if limit is None or repository.store.exists(repository.layout(job_id).spec_key):
        return
    active = 0
    for state in ACTIVE_STATES:
        jobs, _ = repository.list(state, limit=min(1000, limit), tenant=spec.tenant)
        active += len(jobs)
        if active >= limit:
            who = f"tenant {spec.tenant!r}" if spec.tenant else "this deployment"
            raise HttpError(429, f"{who} already has {limit} job(s) queued or running, the "
                                "max_jobs_in_flight limit; submit again when one has ended",
                           headers={"Retry-After": "30"})

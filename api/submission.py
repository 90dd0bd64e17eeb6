"""Checks at submit, so a job that cannot run is refused with a message instead of failing later.

Only the head of the input is read: the first lines of JSONL, a Parquet file's footer, or the
header row of CSV and TSV.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from bulkinfer.api.dependencies import ApiContext
from bulkinfer.api.dispatch import enqueue_plan
from bulkinfer.api.errors import HttpError, invalid_model
from bulkinfer.api.estimate import estimate_spec
from bulkinfer.api.storage_rules import (
    Kind,
    StorageRules,
    check_location,
    claim_output_folder,
    release_output_folder,
    where,
)
from bulkinfer.jobs.deadlines import window_seconds
from bulkinfer.jobs.errors import InputError
from bulkinfer.jobs.formats.batch_task import SUBMIT_SCAN_BYTES, task_given, with_task_of_lines
from bulkinfer.jobs.formats.csv_dialect import CsvDialect
from bulkinfer.jobs.formats.csv_header import check_header, read_header
from bulkinfer.jobs.formats.detect import resolve_spec
from bulkinfer.jobs.formats.json_text import UnreadableJson, loads_untrusted
from bulkinfer.jobs.formats.lines import iter_lines_in_range
from bulkinfer.jobs.limits import in_flight_message, jobs_in_flight
from bulkinfer.jobs.lora_adapters import ADAPTER_CONFIG, is_adapter_location
from bulkinfer.jobs.model_checkpoint import checkpoint_refusal
from bulkinfer.jobs.object_store.base import ObjectNotFound, ObjectStore
from bulkinfer.jobs.object_store.factory import split_uri
from bulkinfer.jobs.output_tokens import max_tokens_problem
from bulkinfer.jobs.planning.estimate_report import JobEstimate
from bulkinfer.jobs.planning.sharding import open_parquet
from bulkinfer.jobs.spec import (
    DELIMITED_FORMATS,
    SERVER_SET_FIELDS,
    InputFormat,
    JobSpec,
    server_set_problems,
)
from bulkinfer.jobs.state.repository import JobNotFound, JobRepository
from bulkinfer.jobs.state.status import JobState, JobStatus
from bulkinfer.jobs.storage_rules import local_path_problem
from bulkinfer.jobs.webhooks import destination_problem
from bulkinfer.jobs.workers import live_workers, unservable_reason

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
    path, problem = local_path_problem(context.settings, uri, field, key)
    if path is None:
        raise HttpError(400, str(problem))
    from bulkinfer.jobs.object_store.local import LocalObjectStore

    return LocalObjectStore("/"), path.as_posix().lstrip("/")


def check_model(context: ApiContext, spec: JobSpec) -> JobSpec:
    """The spec with its model resolved: a `model_aliases` name becomes the served model it names,
    which the job runs and stores (UnknownModel → 400 naming the served models and the aliases)."""
    served = context.registry.resolve(spec.model)
    if served != spec.model:
        spec = spec.model_copy(update={"model": served})
    repository = context.repository
    # Read from the checkpoint itself where the API can (a quantized scheme the engine does not run),
    # else what a worker's load error said (its architecture, say).
    reason = checkpoint_refusal(context.registry.location(spec.model), context.s3_store) or \
        unservable_reason(live_workers(repository.redis, repository.namespace), spec.model)
    if reason is not None:  # the workers' load error names the architectures the engine serves
        raise HttpError(400, f"model {spec.model!r} cannot run here: {reason}", param="model")
    check_lora(context, spec)
    return spec


def check_lora(context: ApiContext, spec: JobSpec) -> None:
    """The job's own adapter: a name registered on its model (UnknownAdapter → 400 naming those that
    are), or a location this deployment runs adapters from and the caller may read, holding an
    adapter_config.json. (A row's adapter name is checked by the worker: that row's error.)"""
    if spec.lora is None:
        return
    if not is_adapter_location(spec.lora):
        context.registry.adapters.get(spec.model, spec.lora)
        return
    if not context.settings.lora_enabled:
        raise HttpError(400, f"lora {spec.lora!r}: this deployment runs no LoRA adapters (its enable_lora "
                             "setting is off and none is registered)", param="lora")
    store, key = locate(context, spec.lora, "lora")
    check_where(context, spec.tenant, spec.lora, "lora", store, key, "folder")
    config_key = f"{key.rstrip('/')}/{ADAPTER_CONFIG}"
    try:
        found = store.exists(config_key)
    except Exception as error:  # noqa: BLE001 - S3 says why (no bucket, denied, unreachable)
        raise HttpError(400, f"lora {spec.lora!r}: cannot read it ({error})", param="lora") from None
    if not found:
        raise HttpError(400, f"lora {spec.lora!r}: no LoRA adapter there ({ADAPTER_CONFIG} is missing)",
                        param="lora")


def check_readable(store: ObjectStore, key: str, what: str) -> None:
    """400 unless the input (`what`: `input_uri <uri>`, or the uploaded file) has bytes to read."""
    try:
        info = store.head(key)
    except ObjectNotFound:
        raise HttpError(400, f"{what}: no such object") from None
    except Exception as error:  # noqa: BLE001 - S3 says why (no bucket, denied, unreachable)
        raise HttpError(400, f"{what}: cannot read it ({error})") from None
    if info.size == 0:
        raise HttpError(400, f"{what}: the file is empty")


def head_records(store: ObjectStore, key: str) -> list[dict[str, object]]:
    """The first rows of a JSONL file that are JSON objects (bad lines are row errors later)."""
    records: list[dict[str, object]] = []
    for line in iter_lines_in_range(store, key, 0, HEAD_BYTES):
        if len(records) == HEAD_ROWS:
            break
        try:
            record = loads_untrusted(line.data)
        except UnreadableJson:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def check_columns(spec: JobSpec, store: ObjectStore, key: str, uri: str) -> None:
    """A column the spec needs that the head does not have at all is a spec mistake: refuse it.
    (A column only some rows lack makes those rows fail, not the job.) `uri`: the input as the
    user named it.
    """
    required = spec.required_columns()
    if spec.input_format in DELIMITED_FORMATS:
        check_header(spec, read_header(store, key, CsvDialect.of_input(spec), uri), uri)
        return
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


def check_priority(context: ApiContext, tenant: str | None, priority: int) -> None:
    """403 when the deployment does not let `tenant` use `priority` (jobs/priority_caps.py): refused,
    not lowered, so nobody believes a job runs sooner than it will."""
    problem = context.settings.priority_problem(tenant, priority)
    if problem is not None:
        raise HttpError(403, problem)


def check_max_tokens(context: ApiContext, spec: JobSpec) -> None:
    """400 for a job whose max_tokens is above the deployment's max_tokens_cap (a row's own is that
    row's invalid_sampling error, named the same way)."""
    problem = max_tokens_problem(spec.sampling.max_tokens, context.settings.tokens_cap, "sampling.max_tokens")
    if problem is not None:
        raise HttpError(400, f"invalid job spec: {problem}")


def validate_input(context: ApiContext, spec: JobSpec, store: ObjectStore, key: str,
                   upload_name: str | None = None) -> JobSpec:
    """The spec resolved against its input (format detected, columns checked): what job.json holds.
    `upload_name`: the name of the file the user uploaded, which messages call the input by (its key
    in the job store is the service's own)."""
    check_priority(context, spec.tenant, spec.priority)
    check_max_tokens(context, spec)
    check_webhook(context, spec.webhook_url)
    check_completion_window(context, spec)
    shown = spec.input_uri if upload_name is None else repr(upload_name)
    check_readable(store, key, f"input_uri {shown}" if upload_name is None else f"the uploaded file {shown}")
    try:
        # OpenAI batch lines with no task given: the urls of the head's lines decide it.
        resolved = with_task_of_lines(resolve_spec(spec, store, key), task_given(spec), store, key,
                                      SUBMIT_SCAN_BYTES)
    except ValidationError as error:
        raise invalid_model(error) from None
    check_columns(resolved, store, key, shown)
    if resolved.output_uri:
        output_store, output_key = locate(context, resolved.output_uri, "output_uri")
        check_where(context, resolved.tenant, resolved.output_uri, "output_uri", output_store, output_key,
                    "folder")
    return resolved


def check_where(context: ApiContext, tenant: str | None, uri: str, field: str, store: ObjectStore, key: str,
                kind: Kind) -> None:
    """403 unless `tenant`'s caller may use this location (api/storage_rules.py says the rules)."""
    location = where(store, key)
    if kind == "prefix" and key.endswith("/") and not location.endswith("/"):
        location += "/"  # a resolved local path lost it; the listing keeps it
    check_location(StorageRules.of(context.settings), tenant, uri, field, location, kind,
                   upload_owner=lambda job_id: context.repository.get_spec(job_id).tenant)


def claim_output(context: ApiContext, spec: JobSpec, job_id: str) -> None:
    """An output_uri folder holds one job's parts: claim it for this job (409 if another has it)."""
    if spec.output_uri:
        store, key = locate(context, spec.output_uri, "output_uri")
        claim_output_folder(store, key, spec.output_uri, job_id,
                            related=lambda owner: owner in retried_jobs(context, spec),
                            may_name=lambda owner: _same_tenant(context, spec.tenant, owner),
                            backs=lambda owner, folder: _backs(context, owner, store, folder))


@contextmanager
def claimed_output(context: ApiContext, spec: JobSpec, job_id: str) -> Iterator[None]:
    """Claim the output folder for the job the body creates; if it fails before the job stands
    behind the claim (an idempotency conflict, a store error), release it: the folder stays usable."""
    claim_output(context, spec, job_id)
    try:
        yield
    except BaseException:
        if spec.output_uri:
            store, key = locate(context, spec.output_uri, "output_uri")
            if _backs(context, job_id, store, key.strip("/")) is not True:
                release_output_folder(store, key, job_id)
        raise


def _backs(context: ApiContext, job_id: str, store: ObjectStore, folder: str) -> bool | None:
    """Whether job `job_id` stands behind a claim of `folder` in `store`: None when there is no such
    job, False when its spec's output folder is another."""
    try:
        spec = context.repository.get_spec(job_id)
    except (JobNotFound, ValueError):  # never created, or not a job id at all
        return None
    if not spec.output_uri:
        return False
    try:
        owner_store, owner_key = locate(context, spec.output_uri, "output_uri")
    except HttpError:  # its folder no longer resolves here (settings changed): keep its claim
        return True
    return where(owner_store, owner_key.strip("/")) == where(store, folder)


def retried_jobs(context: ApiContext, spec: JobSpec) -> set[str]:
    """The jobs a retry's chain goes back through (its parent, the parent's parent, ...)."""
    chain: set[str] = set()
    parent = spec.parent_job_id
    while parent is not None and parent not in chain:
        chain.add(parent)
        parent = context.repository.get_spec(parent).parent_job_id
    return chain


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
    return enqueue_created(context, context.repository.create(spec, job_id=job_id))


def enqueue_created(context: ApiContext, status: JobStatus) -> JobStatus:
    """Ask the control queue to plan a created job that is still queued; 503 when the broker is down."""
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
    spec = check_model(context, spec)
    store, key = locate(context, spec.input_uri, "input_uri")
    check_where(context, spec.tenant, spec.input_uri, "input_uri", store, key, "object")
    resolved = validate_input(context, spec, store, key)
    if resolved.dry_run:
        return estimate_spec(context, resolved, store, key)
    job_id = JobRepository.job_id_for(resolved)
    check_in_flight(context, resolved, job_id)
    with claimed_output(context, resolved, job_id):
        return create_and_enqueue(context, resolved, job_id)


def check_in_flight(context: ApiContext, spec: JobSpec, job_id: str) -> None:
    """429 when the tenant already has `max_jobs_in_flight` jobs not yet ended (a submit that finds
    its own job again, by its idempotency key, is never refused)."""
    limit = context.settings.max_jobs_in_flight
    repository = context.repository
    if limit is None or repository.store.exists(repository.layout(job_id).spec_key):
        return
    if jobs_in_flight(repository, spec.tenant, limit) >= limit:
        raise HttpError(429, f"{in_flight_message(spec.tenant, limit)}; submit again when one has ended",
                        headers={"Retry-After": "30"})

"""Schedules: a cron expression, an input prefix (or glob) and a job template.

Each tick of a due schedule submits one job per new input object (jobs/scheduling/schedule_tick.py). A
schedule is durable in the job store (`<prefix>/schedules/<id>.json`, rewritten only by pause and
resume); Redis holds what changes on every tick (last tick, counts, last error), the per-schedule
tick lock and the objects already submitted. Losing Redis loses no schedule, and never doubles a
job: job ids derive from (schedule, object key, ETag) through the idempotency key.
"""

from __future__ import annotations

import builtins
import fnmatch
import hashlib
import json
import logging
import re
import uuid
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from bulkinfer.jobs.errors import LookupFailed
from bulkinfer.jobs.names import schedule_key
from bulkinfer.jobs.object_store.base import AlreadyExists, ObjectNotFound, ObjectStore
from bulkinfer.jobs.object_store.factory import split_uri
from bulkinfer.jobs.spec import SERVER_SET_FIELDS, URI_PATTERN, JobSpec, check_user_spec, validation_messages
from bulkinfer.jobs.webhooks import check_webhook_url

if TYPE_CHECKING:
    import redis

    from bulkinfer.jobs.state.repository import JobRepository

logger = logging.getLogger(__name__)

DEFAULT_NAMESPACE = "bulkinfer"
SCHEDULE_ID_PATTERN = re.compile(r"^sched-[0-9a-f]{32}$")
GLOB_CHARACTERS = "*?["
# Fields a template may not set: the tick fills them in per input object.
TICK_FIELDS = ("input_uri", "idempotency_key")
SCHEDULE_METADATA_KEY = "schedule_id"
TEMPLATE_PROBE_URI = "s3://bucket/template-check"  # a template is checked as a JobSpec with this input


def check_template(template: dict[str, Any]) -> None:
    """ValueError for a template field that makes no sense on a job a tick submits: `dry_run` (each
    tick would create and run, as real jobs, what the user asked only to be estimated)."""
    if template.get("dry_run"):
        raise ValueError("dry_run: a schedule submits real jobs at every tick; estimate a template "
                         "with POST /jobs and dry_run, then leave dry_run out")


class ScheduleNotFound(LookupFailed):
    def __init__(self, schedule_id: str) -> None:
        super().__init__(f"no schedule {schedule_id!r}")
        self.schedule_id = schedule_id


class ScheduleUnreadable(ValueError):
    """A stored schedule that no longer validates (a rule tightened after it was stored)."""

    def __init__(self, schedule_id: str, tenant: str | None, problems: list[str]) -> None:
        super().__init__(f"schedule {schedule_id} no longer reads ({'; '.join(problems)}): delete it and "
                         "create it again")
        self.schedule_id = schedule_id
        self.tenant = tenant


def _stored_tenant(data: bytes) -> str | None:
    """The owner a stored schedule names, read without validating the rest."""
    try:
        tenant = json.loads(data).get("tenant")
    except (ValueError, AttributeError):
        return None
    return tenant if isinstance(tenant, str) else None


def check_cron(expression: str) -> str:
    """The expression if croniter accepts it: 5 fields (minute hour day month weekday, UTC) or 6
    (a sixth field of seconds). ValueError naming the expression and the problem otherwise.
    """
    fields = expression.split()
    if len(fields) not in (5, 6):
        raise ValueError(f"{expression!r} is not a cron expression: it has {len(fields)} fields; use 5 "
                         "(minute hour day-of-month month day-of-week) or 6 (the same, then seconds)")
    try:
        from croniter import croniter
    except ImportError:  # the SDK (client extra) reads schedules back; the server checked them fully
        return " ".join(fields)
    try:
        croniter(expression)
    except (ValueError, KeyError) as error:
        raise ValueError(f"{expression!r} is not a valid cron expression: {error}") from None
    return " ".join(fields)


def next_fire(expression: str, after: datetime) -> datetime | None:
    """The first time strictly after `after` that the expression names (UTC); None when no date
    matches it (`0 0 31 2 *`: February has no 31st)."""
    from croniter import CroniterBadDateError, croniter

    try:
        return croniter(expression, after.astimezone(UTC)).get_next(datetime)
    except CroniterBadDateError:
        return None


def check_fires(expression: str) -> str:
    """The expression if some date matches it; ValueError naming it otherwise (a new schedule's
    check: one stored before it is read as it is, and simply never ticks)."""
    try:
        import croniter  # noqa: F401
    except ImportError:  # the SDK (client extra) without croniter: the server checks it
        return expression
    if next_fire(expression, datetime.now(UTC)) is None:
        raise ValueError(f"{expression!r} never fires: no date matches it (e.g. a day the month "
                         "never has)")
    return expression


def split_input(input_prefix: str) -> tuple[str, str | None]:
    """(the literal prefix URI to list, the glob pattern on full keys or None).

    `s3://b/in/` lists `in/`; `s3://b/in/*.jsonl` lists `in/` and keeps keys matching `in/*.jsonl`
    (fnmatch: `*` also crosses `/`).
    """
    scheme, bucket, key = split_uri(input_prefix)
    cut = min((key.index(c) for c in GLOB_CHARACTERS if c in key), default=None)
    if cut is None:
        return input_prefix, None
    literal = key[:cut]
    base = f"s3://{bucket}/{literal}" if scheme == "s3" else "/" + literal
    return base, key


def matches(pattern: str | None, key: str) -> bool:
    return pattern is None or fnmatch.fnmatchcase(key, pattern)


# Five or six fields of cron characters, as the published schema states it (check_cron has the rest).
CRON_PATTERN = r"^\s*[0-9*,/?LW#A-Za-z-]+(\s+[0-9*,/?LW#A-Za-z-]+){4,5}\s*$"


class ScheduleSpec(BaseModel):
    """What a user posts to create a schedule. Unknown fields are rejected."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    # A new template may not set the fields only the server sets, nor a new cron be one that never
    # fires; a stored one is read whatever it holds (one written before those checks), and its tick
    # refuses it instead (`job_spec`), or it never ticks.
    refuses_server_set_fields: ClassVar[bool] = True

    name: str | None = Field(None, max_length=200)
    cron: str = Field(description="5 fields (UTC), or 6 with seconds last; e.g. '*/10 * * * *'",
                      json_schema_extra={"pattern": CRON_PATTERN})
    input_prefix: str = Field(description="s3://bucket/prefix/ (or a local store path); a glob when it "
                                          "contains * ? or [, e.g. s3://bucket/in/*.jsonl",
                              json_schema_extra={"pattern": URI_PATTERN})
    job: dict[str, Any] = Field(description="a JobSpec without input_uri, idempotency_key and the fields "
                                "only the server sets (parent_job_id, retry_error_codes), and not a dry run",
                                json_schema_extra={"required": ["model"], "properties": {
                                    **{name: {"type": "null"} for name in SERVER_SET_FIELDS},
                                    "dry_run": {"const": False}}})
    webhook_url: str | None = Field(None, description="copied into every job the schedule submits")
    paused: bool = False
    tenant: str | None = Field(None, description="whose schedule it is (and its jobs'): set by the API from "
                                                 "the caller's key (a value sent is replaced)")

    @field_validator("cron")
    @classmethod
    def _cron_is_valid(cls, value: str) -> str:
        value = check_cron(value)
        return check_fires(value) if cls.refuses_server_set_fields else value

    @field_validator("input_prefix")
    @classmethod
    def _input_is_a_prefix(cls, value: str) -> str:
        split_uri(value)  # ValueError naming the problem
        return value

    @field_validator("webhook_url")
    @classmethod
    def _webhook_is_http(cls, value: str | None) -> str | None:
        return check_webhook_url(value) if value is not None else None

    @field_validator("job")
    @classmethod
    def _template_is_a_job_spec(cls, value: dict[str, Any]) -> dict[str, Any]:
        present = [name for name in TICK_FIELDS if name in value]
        if present:
            raise ValueError(f"{', '.join(present)}: set per input object by the schedule; leave it out")
        if cls.refuses_server_set_fields:
            check_user_spec(value)  # e.g. parent_job_id: its jobs would merge another job's rows
            check_template(value)
        if value.get("output_uri"):
            raise ValueError("output_uri: every job a schedule submits writes to its own folder (one "
                             "output_uri for all of them would make their parts overwrite each other); "
                             "leave it out")
        probe = {**value, "input_uri": TEMPLATE_PROBE_URI}
        if isinstance(value.get("metadata", {}), dict):  # leaves room for the schedule id
            probe["metadata"] = {**value.get("metadata", {}), SCHEDULE_METADATA_KEY: "x"}
        try:
            JobSpec.model_validate(probe)
        except ValidationError as error:
            raise ValueError("; ".join(validation_messages(error))) from None
        return value


class Schedule(ScheduleSpec):
    """A stored schedule."""

    refuses_server_set_fields: ClassVar[bool] = False

    id: str
    created_at: datetime

    def job_spec(self, input_uri: str, key: str, etag: str) -> JobSpec:
        """The job for one input object: the template, its URI, and an idempotency key derived from
        (schedule, key, ETag), so a repeated tick or a restarted scheduler finds the same job.
        """
        data = dict(self.job)
        check_user_spec(data)  # ServerSetField: a template stored before create refused them
        check_template(data)
        data["input_uri"] = input_uri
        data["idempotency_key"] = idempotency_key(self.id, key, etag)
        data["metadata"] = {**(data.get("metadata") or {}), SCHEDULE_METADATA_KEY: self.id}
        if self.webhook_url and not data.get("webhook_url"):
            data["webhook_url"] = self.webhook_url
        data["tenant"] = self.tenant  # the schedule's owner owns its jobs
        return JobSpec.model_validate(data)


class ScheduleRuntime(BaseModel):
    """What changes on every tick (kept in Redis)."""

    last_tick_at: datetime | None = None
    next_tick_at: datetime | None = None
    jobs_submitted: int = 0
    last_error: str | None = None


class ScheduleView(Schedule):
    """A schedule as the API returns it: the stored fields and the tick state."""

    runtime: ScheduleRuntime


class SubmittedObject(BaseModel):
    key: str
    etag: str
    job_id: str
    submitted_at: datetime


class TickReport(BaseModel):
    """What one tick did (`POST /schedules/{id}/tick`)."""

    schedule_id: str
    submitted: list[SubmittedObject] = Field(description="objects that got a job in this tick")
    error: str | None = Field(None, description="why the tick stopped early (listing failed, …)")
    deferred: int = Field(0, description="new objects left for a later tick because the schedule's tenant "
                                         "has max_jobs_in_flight jobs queued or running")


def fingerprint(key: str, etag: str) -> str:
    """One short name per (object key, ETag) pair."""
    return hashlib.sha256(f"{key}\0{etag}".encode()).hexdigest()


def idempotency_key(schedule_id: str, key: str, etag: str) -> str:
    """Keys may be 1,024 bytes long and idempotency keys at most 256, so the pair is hashed."""
    return f"{schedule_id}:{fingerprint(key, etag)}"


def new_schedule_id() -> str:
    return f"sched-{uuid.uuid4().hex}"


class ScheduleRepository:
    def __init__(self, store: ObjectStore, redis_client: redis.Redis, prefix: str = "",
                 namespace: str = DEFAULT_NAMESPACE) -> None:
        self.store = store
        self.redis = redis_client
        self.prefix = prefix.strip("/")
        self.namespace = namespace

    @classmethod
    def beside(cls, jobs: JobRepository) -> ScheduleRepository:
        """Schedules in the same store, prefix and Redis as these jobs."""
        return cls(jobs.store, jobs.redis, prefix=jobs.prefix, namespace=jobs.namespace)

    # -- keys -------------------------------------------------------------------------------

    @property
    def _folder(self) -> str:
        return f"{self.prefix}/schedules/" if self.prefix else "schedules/"

    def _key(self, schedule_id: str) -> str:
        if not SCHEDULE_ID_PATTERN.match(schedule_id):
            raise ScheduleNotFound(schedule_id)
        return f"{self._folder}{schedule_id}.json"

    def _redis_key(self, schedule_id: str, what: str) -> str:
        return schedule_key(self.namespace, schedule_id, what)

    def lock(self, schedule_id: str, timeout_s: float = 300) -> Any:
        """The tick lock: one tick of a schedule at a time, across workers and the API."""
        return self.redis.lock(self._redis_key(schedule_id, "lock"), timeout=timeout_s, blocking_timeout=60)

    # -- the schedule -----------------------------------------------------------------------

    def create(self, spec: ScheduleSpec) -> Schedule:
        schedule = Schedule(**spec.model_dump(), id=new_schedule_id(), created_at=datetime.now(UTC))
        data = schedule.model_dump_json().encode()
        try:
            self.store.put_bytes(self._key(schedule.id), data, if_none_match=True)
        except AlreadyExists:  # a uuid4 collision: never in practice
            raise RuntimeError(f"schedule {schedule.id} already exists") from None
        return schedule

    def get(self, schedule_id: str) -> Schedule:
        """ScheduleNotFound for an unknown id; ScheduleUnreadable for one stored under rules that
        have tightened since (its owner can still delete it)."""
        try:
            data = self.store.get_bytes(self._key(schedule_id))
        except ObjectNotFound:
            raise ScheduleNotFound(schedule_id) from None
        try:
            return Schedule.model_validate_json(data)
        except ValidationError as error:
            raise ScheduleUnreadable(schedule_id, _stored_tenant(data), validation_messages(error)) from None

    def list(self) -> builtins.list[Schedule]:
        """Every schedule, oldest first (schedules are few; the store is their index). One that no
        longer reads (a rule tightened since it was stored) is logged and left out: it must not
        take every tenant's listing and ticks down with it."""
        schedules = []
        for info in self.store.list(self._folder):
            name = info.key.removeprefix(self._folder).removesuffix(".json")
            if SCHEDULE_ID_PATTERN.match(name):
                try:
                    schedules.append(self.get(name))
                except ScheduleNotFound:  # deleted while we listed
                    continue
                except ScheduleUnreadable as error:
                    logger.error("%s; left out", error)
        return sorted(schedules, key=lambda schedule: schedule.created_at)

    def set_paused(self, schedule_id: str, paused: bool) -> Schedule:
        schedule = self.get(schedule_id)
        if schedule.paused != paused:
            schedule = schedule.model_copy(update={"paused": paused})
            self.store.put_bytes(self._key(schedule_id), schedule.model_dump_json().encode())
        return schedule

    def delete(self, schedule_id: str) -> None:
        """Remove the schedule and its tick state; the jobs it submitted stay."""
        if not self.store.exists(self._key(schedule_id)):
            raise ScheduleNotFound(schedule_id)
        self.store.delete(self._key(schedule_id))
        self.redis.delete(*(self._redis_key(schedule_id, what) for what in ("state", "seen")))

    # -- tick state -------------------------------------------------------------------------

    def runtime(self, schedule: Schedule) -> ScheduleRuntime:
        raw = {k.decode() if isinstance(k, bytes) else k: v.decode() if isinstance(v, bytes) else v
               for k, v in self.redis.hgetall(self._redis_key(schedule.id, "state")).items()}
        last = datetime.fromisoformat(raw["last_tick_at"]) if raw.get("last_tick_at") else None
        next_at = None if schedule.paused else next_fire(schedule.cron, last or schedule.created_at)
        return ScheduleRuntime(last_tick_at=last, next_tick_at=next_at,
                               jobs_submitted=int(raw.get("jobs_submitted", 0)),
                               last_error=raw.get("last_error") or None)

    def view(self, schedule: Schedule) -> ScheduleView:
        return ScheduleView(**schedule.model_dump(), runtime=self.runtime(schedule))

    def record_tick(self, schedule_id: str, at: datetime, error: str | None) -> None:
        key = self._redis_key(schedule_id, "state")
        self.redis.hset(key, mapping={"last_tick_at": at.isoformat(), "last_error": error or ""})

    def seen(self, schedule_id: str) -> set[str]:
        """Fingerprints of the (key, ETag) pairs already submitted."""
        return {f.decode() if isinstance(f, bytes) else f
                for f in self.redis.hkeys(self._redis_key(schedule_id, "seen"))}

    def mark_submitted(self, schedule_id: str, submitted: SubmittedObject) -> None:
        added = self.redis.hsetnx(self._redis_key(schedule_id, "seen"),
                                  fingerprint(submitted.key, submitted.etag), submitted.model_dump_json())
        if added:
            self.redis.hincrby(self._redis_key(schedule_id, "state"), "jobs_submitted", 1)

    def submitted(self, schedule_id: str) -> builtins.list[SubmittedObject]:
        """The objects submitted so far (as Redis remembers them), oldest first."""
        values = self.redis.hvals(self._redis_key(schedule_id, "seen"))
        records = [SubmittedObject.model_validate_json(value) for value in values]
        return sorted(records, key=lambda record: (record.submitted_at, record.key))


"""`JobRepository`: a job's spec, state and counts — live in Redis, durable in the object store.

Redis holds the state (one hash per job), a creation-ordered index for listing (one sorted set for
all jobs, one per state), the cancel flags and, through `JobCounters`, the live counts. The store
holds `job.json` (the spec, written once), `status.json` (rewritten on every transition) and
`plan.json`. Whatever Redis loses, `get` and `transition` put back from the store.

A job with an idempotency key gets its id from the key, so the store's write-once `job.json`
decides between "the same job again" and "a conflict" even with Redis empty or two submits racing.
"""

from __future__ import annotations

import builtins
import hashlib
import json
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import redis
from pydantic import BaseModel

from bulkinfer.jobs.deadlines import register_deadline
from bulkinfer.jobs.errors import LookupFailed
from bulkinfer.jobs.layout import JobLayout, jobs_root
from bulkinfer.jobs.names import NO_TENANT, cancel_key, jobs_tag
from bulkinfer.jobs.object_store.base import AlreadyExists, ObjectNotFound, ObjectStore
from bulkinfer.jobs.planning.sharding import ShardPlan
from bulkinfer.jobs.spec import JobSpec
from bulkinfer.jobs.state.counters import CountersMissing, CounterSnapshot, JobCounters
from bulkinfer.jobs.state.manifest import read_manifest
from bulkinfer.jobs.state.status import (
    ALLOWED_TRANSITIONS,
    COMPLETED_STATES,
    IllegalTransition,
    JobState,
    JobStatus,
)

DEFAULT_NAMESPACE = "bulkinfer"
INDEX_REBUILD_LOCK_MS = 5 * 60 * 1000
LIST_SCAN_PAGE = 200  # index entries read at a time when a listing keeps one tenant's jobs
STATES = list(JobState)
# How far along the lifecycle a state is: a transition to an earlier state was already made.
LIFECYCLE_RANK = {JobState.QUEUED: 0, JobState.RUNNING: 1, JobState.FINALIZING: 2,
                  JobState.SUCCEEDED: 3, JobState.FAILED: 3, JobState.CANCELLED: 3, JobState.EXPIRED: 3}

# KEYS: job hash, index, then the state indexes in STATES order.
# ARGV: index member, then the hash's field/value pairs. Records the job unless Redis has it.
RECORD_IF_ABSENT_SCRIPT = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local state
for i = 2, #ARGV, 2 do
  redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
  if ARGV[i] == 'state' then state = ARGV[i + 1] end
end
redis.call('HSET', KEYS[1], 'index_member', ARGV[1])
redis.call('ZADD', KEYS[2], 0, ARGV[1])
for i = 3, #KEYS do
  if KEYS[i]:sub(-#state - 1) == ':' .. state then redis.call('ZADD', KEYS[i], 0, ARGV[1]) end
end
return 1
"""
# KEYS: job hash, then the state indexes in STATES order.
# ARGV: target, ",allowed,sources,", now, "1" if target is terminal, error, output URIs (JSON),
#       manifest URI, then the state names in STATES order.
# Returns {outcome, current}: outcome is missing | same | illegal | moved.
TRANSITION_SCRIPT = """
local current = redis.call('HGET', KEYS[1], 'state')
if not current then return {'missing', ''} end
if current == ARGV[1] then return {'same', current} end
if not string.find(ARGV[2], ',' .. current .. ',', 1, true) then return {'illegal', current} end
local member = redis.call('HGET', KEYS[1], 'index_member')
redis.call('HSET', KEYS[1], 'state', ARGV[1])
if ARGV[1] == 'running' then redis.call('HSET', KEYS[1], 'started_at', ARGV[3]) end
if ARGV[1] == 'finalizing' then redis.call('HSET', KEYS[1], 'finalizing_at', ARGV[3]) end
if ARGV[4] == '1' then redis.call('HSET', KEYS[1], 'finished_at', ARGV[3]) end
if ARGV[5] ~= '' then redis.call('HSET', KEYS[1], 'error', ARGV[5]) end
if ARGV[6] ~= '' then redis.call('HSET', KEYS[1], 'output_uris', ARGV[6]) end
if ARGV[7] ~= '' then redis.call('HSET', KEYS[1], 'manifest_uri', ARGV[7]) end
for i = 2, #KEYS do
  if ARGV[i + 6] == current then redis.call('ZREM', KEYS[i], member) end
  if ARGV[i + 6] == ARGV[1] then redis.call('ZADD', KEYS[i], 0, member) end
end
return {'moved', current}
"""


class JobNotFound(LookupFailed):
    def __init__(self, job_id: str) -> None:
        super().__init__(f"no job {job_id!r}")
        self.job_id = job_id


class JobConflict(ValueError):
    """A job with this id already exists with a different spec."""

    def __init__(self, message: str, job_id: str) -> None:
        super().__init__(message)
        self.job_id = job_id


class IdempotencyConflict(JobConflict):
    """The idempotency key was used before for a job with a different spec."""


class StoredPlan(BaseModel):
    shards: list[ShardPlan]


def new_job_id() -> str:
    return f"job-{uuid.uuid4().hex}"


def idempotent_job_id(idempotency_key: str, tenant: str | None = None,
                      parent_job_id: str | None = None) -> str:
    """The job id an idempotency key gives: per tenant, so two tenants' equal keys never meet. A
    retry's key (`parent_job_id` set) has a space of its own per parent job: the same key on a
    submit, or on a retry of another job, is another job (a retry must never land on a submit's job)."""
    scope = f"{tenant}\x00" if tenant else ""
    kind = f"bulkinfer-retry-idempotency:{parent_job_id}\x00" if parent_job_id else "bulkinfer-idempotency:"
    digest = hashlib.sha256(f"{kind}{scope}{idempotency_key}".encode()).hexdigest()
    return f"job-{digest[:32]}"


def _timestamp(value: datetime | None) -> str:
    return value.isoformat() if value else ""


def _datetime(value: str | None) -> datetime | None:
    return datetime.fromisoformat(value) if value else None


class JobRepository:
    def __init__(self, store: ObjectStore, redis_client: redis.Redis, prefix: str = "",
                 namespace: str = DEFAULT_NAMESPACE) -> None:
        self.store = store
        self.redis = redis_client
        self.prefix = prefix.strip("/")
        self.namespace = namespace
        # One hash tag for the state keys, so each script's keys share a Redis Cluster slot.
        self._tag = jobs_tag(namespace)
        self._record_if_absent = redis_client.register_script(RECORD_IF_ABSENT_SCRIPT)
        self._transition = redis_client.register_script(TRANSITION_SCRIPT)

    # -- keys -------------------------------------------------------------------------------

    def layout(self, job_id: str) -> JobLayout:
        return JobLayout(job_id, prefix=self.prefix)

    def counters(self, job_id: str) -> JobCounters:
        return JobCounters(self.redis, job_id, namespace=self.namespace)

    def _job_key(self, job_id: str) -> str:
        return f"{self._tag}:job:{job_id}"

    @property
    def _index_key(self) -> str:
        return f"{self._tag}:index"

    def _state_index_key(self, state: JobState) -> str:
        return f"{self._tag}:state:{state.value}"

    def _tenant_index_key(self, tenant: str | None) -> str:
        return f"{self._tag}:tenant:{tenant or NO_TENANT}"

    @property
    def _tenant_index_whole_key(self) -> str:
        """Present once every job of the shared index is in its tenant's index too."""
        return f"{self._tag}:tenant-index-whole"

    @property
    def _index_whole_key(self) -> str:
        """Present while the index holds every job in the store; a Redis that lost its data lacks it."""
        return f"{self._tag}:index-whole"

    def _cancel_key(self, job_id: str) -> str:
        return cancel_key(self.namespace, job_id)

    @staticmethod
    def job_id_for(spec: JobSpec) -> str:
        """The id `create` gives this spec: derived from its idempotency key, else a fresh one.

        The API uses it to place an upload under `jobs/<id>/input/` before the job exists.
        """
        if not spec.idempotency_key:
            return new_job_id()
        return idempotent_job_id(spec.idempotency_key, spec.tenant, spec.parent_job_id)

    # -- create and read --------------------------------------------------------------------

    def create(self, spec: JobSpec, *, job_id: str | None = None) -> JobStatus:
        """Write job.json (once) and status.json, and record the job in Redis.

        The same idempotency key (or job id) with an equal `spec_hash()` returns the existing job;
        with a different spec it raises `IdempotencyConflict` (`JobConflict` for a bare job id).
        """
        if spec.idempotency_key:
            derived = self.job_id_for(spec)
            if job_id is not None and job_id != derived:
                raise ValueError(f"a job with an idempotency key has the id {derived} (from "
                                 f"JobRepository.job_id_for), not {job_id}")
            job_id = derived
        job_id = job_id or new_job_id()
        layout = self.layout(job_id)
        try:
            self.store.put_bytes(layout.spec_key, spec.canonical_json().encode(), if_none_match=True)
        except AlreadyExists:
            self._check_same_spec(job_id, spec)
            return self._restore(job_id)
        status = JobStatus(job_id=job_id, tenant=spec.tenant, parent_job_id=spec.parent_job_id)
        window = spec.completion_window_s
        if window is not None:
            status = status.model_copy(update={"expires_at": status.created_at + timedelta(seconds=window)})
        try:
            self.store.put_bytes(layout.status_key, status.model_dump_json().encode(), if_none_match=True)
        except AlreadyExists:  # a racing create of the same job wrote it first
            pass
        self._record(status)
        return self.get(job_id)

    def _check_same_spec(self, job_id: str, spec: JobSpec) -> None:
        existing = self.get_spec(job_id)
        if existing.spec_hash() == spec.spec_hash():
            return
        if spec.idempotency_key:
            raise IdempotencyConflict(
                f"idempotency key {spec.idempotency_key!r} was already used for job {job_id} with a "
                "different spec; use a new key for a different job", job_id)
        raise JobConflict(f"job {job_id} already exists with a different spec", job_id)

    def get_spec(self, job_id: str) -> JobSpec:
        try:
            return JobSpec.model_validate_json(self.store.get_bytes(self.layout(job_id).spec_key))
        except ObjectNotFound:
            raise JobNotFound(job_id) from None

    def get(self, job_id: str) -> JobStatus:
        """State from Redis and counts from `JobCounters`; from the store when Redis lost them."""
        self.layout(job_id)  # validates the id before it reaches a key
        raw = self.redis.hgetall(self._job_key(job_id))
        if not raw:
            return self._restore(job_id)
        status = self._status_from_hash(job_id, raw)
        counts = self._counts(job_id, status.state)
        return status.with_counts(counts.rows, counts.shards, counts.usage) if counts else status

    def list(self, state: JobState | str | None = None, cursor: str | None = None,
             limit: int = 50, tenant: str | None = None) -> tuple[builtins.list[JobStatus], str | None]:
        """Newest first; only `tenant`'s jobs when given. `next_cursor` is None on the last page;
        jobs created after the first page never shift later pages (the cursor is a position in
        creation order).
        """
        if not 1 <= limit <= 1000:
            raise ValueError(f"limit must be 1 to 1000, got {limit}")
        self.ensure_index()
        state = JobState(state) if state else None
        key, filtered = self._listing_index(state, tenant)
        upper = f"({cursor}" if cursor else "+"
        found: builtins.list[tuple[str, JobStatus]] = []  # up to limit + 1: one more says "more"
        while len(found) <= limit:
            members = self.redis.zrange(key, upper, "-", desc=True, bylex=True, offset=0,
                                        num=LIST_SCAN_PAGE if filtered else limit + 1 - len(found))
            names = [_text(member) for member in members]
            for member in names:
                try:
                    status = self.get(member.split(":", 1)[1])
                except JobNotFound:  # deleted from the store; the index entry is stale
                    continue
                if (tenant is None or status.tenant == tenant) and (state is None or status.state == state):
                    found.append((member, status))
                    if len(found) > limit:
                        break
            if not names or len(found) > limit:
                break
            upper = f"({names[-1]}"
        statuses = [status for _, status in found[:limit]]
        return statuses, found[limit - 1][0] if len(found) > limit else None

    def _listing_index(self, state: JobState | None, tenant: str | None) -> tuple[str, bool]:
        """The index a listing walks, and whether its entries still need the state and tenant
        filter. One tenant's listing walks its own index (or, with a state, whichever of its index
        and the state's is smaller): a tenant with few jobs must not make every request read every
        other tenant's jobs."""
        state_key = self._state_index_key(state) if state else self._index_key
        if tenant is None:
            return state_key, False
        if not self._ensure_tenant_index():  # being built by another process: the shared index, filtered
            return state_key, True
        tenant_key = self._tenant_index_key(tenant)
        if state is None:
            return tenant_key, False
        smaller = min((tenant_key, state_key), key=self.redis.zcard)
        return smaller, True

    def _ensure_tenant_index(self) -> bool:
        """Whether every indexed job is in its tenant's index. Jobs recorded before tenant indexes
        existed are added once, from the shared index, by one process at a time."""
        if self.redis.exists(self._tenant_index_whole_key):
            return True
        lock = f"{self._tag}:tenant-index-rebuild"
        if not self.redis.set(lock, 1, nx=True, px=INDEX_REBUILD_LOCK_MS):
            return False
        try:
            upper = "+"
            while members := self.redis.zrange(self._index_key, upper, "-", desc=True, bylex=True, offset=0,
                                               num=1000):
                names = [_text(member) for member in members]
                pipe = self.redis.pipeline(transaction=False)
                for member in names:
                    pipe.hget(self._job_key(member.split(":", 1)[1]), "tenant")
                tenants = pipe.execute()
                pipe = self.redis.pipeline(transaction=False)
                for member, owner in zip(names, tenants, strict=True):
                    if owner is not None:  # None: the job hash is gone; the entry is stale
                        owner = _text(owner)
                        pipe.zadd(self._tenant_index_key(owner or None), {member: 0})
                pipe.execute()
                upper = f"({names[-1]}"
            self.redis.set(self._tenant_index_whole_key, 1)
        finally:
            self.redis.delete(lock)
        return True

    def count_by_state(self) -> dict[str, int]:
        """How many jobs are in each state, every tenant's (one ZCARD per state)."""
        pipe = self.redis.pipeline(transaction=False)
        for state in STATES:
            pipe.zcard(self._state_index_key(state))
        return {state.value: int(count) for state, count in zip(STATES, pipe.execute(), strict=True)}

    def ensure_index(self) -> int:
        """Put back every job of the store that Redis does not know (after Redis lost its data, or
        on a new Redis beside an old store), from its status.json; returns how many. Once done, a
        marker makes later calls one EXISTS; one process rebuilds at a time (the others list what
        is there meanwhile)."""
        if self.redis.exists(self._index_whole_key):
            return 0
        lock = f"{self._tag}:index-rebuild"
        if not self.redis.set(lock, 1, nx=True, px=INDEX_REBUILD_LOCK_MS):
            return 0
        restored = 0
        try:
            for job_id in self._stored_job_ids():
                if not self.redis.exists(self._job_key(job_id)):
                    self._record(self._stored_status(job_id))
                    restored += 1
            self.redis.set(self._index_whole_key, 1)
        finally:
            self.redis.delete(lock)
        return restored

    def _stored_job_ids(self) -> builtins.list[str]:
        jobs_dir = jobs_root(self.prefix)
        ids = []
        for info in self.store.list(jobs_dir):
            job_id, _, name = info.key[len(jobs_dir):].partition("/")
            if name == "job.json":
                ids.append(job_id)
        return ids

    def _stored_status(self, job_id: str) -> JobStatus:
        try:
            return JobStatus.model_validate_json(self.store.get_bytes(self.layout(job_id).status_key))
        except ObjectNotFound:  # a create that stopped before writing it: the job is still queued
            return JobStatus(job_id=job_id, tenant=self.get_spec(job_id).tenant)

    # -- transitions and cancel -------------------------------------------------------------

    def transition(self, job_id: str, target: JobState | str, error: str | None = None) -> JobStatus:
        """Move the job to `target` atomically and write status.json.

        A transition already made (the job is in `target`, or past it on the way to a final
        state) is a no-op: tasks may run twice. Raises `IllegalTransition` otherwise, e.g. to
        `succeeded` from `cancelled`.
        """
        return self._move(job_id, target, error)[0]

    def _move(self, job_id: str, target: JobState | str, error: str | None = None) -> tuple[JobStatus, bool]:
        """`transition`, and whether this call moved the job (False: it was there, or past it)."""
        target = JobState(target)
        if target == JobState.FAILED and not error:
            raise ValueError("a failed job needs an error message saying why")
        output_uris, manifest_uri = self._manifest_uris(job_id) if target in COMPLETED_STATES else ("", "")
        sources = "," + ",".join(s.value for s in STATES if target in ALLOWED_TRANSITIONS[s]) + ","
        arguments = [target.value, sources, _timestamp(datetime.now(UTC)), "1" if target.is_terminal else "",
                     error or "", output_uris, manifest_uri, *(s.value for s in STATES)]
        keys = [self._job_key(job_id), *(self._state_index_key(s) for s in STATES)]
        outcome, current = (item.decode() if isinstance(item, bytes) else item
                            for item in self._transition(keys=keys, args=arguments))
        if outcome == "missing":
            self._restore(job_id)
            outcome, current = (item.decode() if isinstance(item, bytes) else item
                                for item in self._transition(keys=keys, args=arguments))
        if outcome == "illegal":
            current_state = JobState(current)
            if not target.is_terminal and LIFECYCLE_RANK[current_state] > LIFECYCLE_RANK[target]:
                return self.get(job_id), False
            raise IllegalTransition(current_state, target)
        if outcome == "moved":
            return self._write_status(job_id), True
        return self.get(job_id), False

    def request_cancel(self, job_id: str) -> JobStatus:
        """Raise the cancel flag and move a job that has not finished to `cancelled`.

        A finished job stays as it was (the returned status says which state it ended in).
        """
        return self.cancel(job_id)[0]

    def cancel(self, job_id: str) -> tuple[JobStatus, bool]:
        """`request_cancel`, and whether this call cancelled the job (False: it had ended already,
        cancelled before included): what the batch APIs answer 409 to."""
        self.get(job_id)  # JobNotFound for an unknown job
        self.redis.set(self._cancel_key(job_id), "1")
        try:
            return self._move(job_id, JobState.CANCELLED)
        except IllegalTransition:
            return self.get(job_id), False

    def stop_running_shards(self, job_id: str) -> None:
        """Raise the flag every running shard of the job polls (the cancel flag): they stop, abort
        their rows and commit nothing. For a job that ended without finishing them (it failed)."""
        self.redis.set(self._cancel_key(job_id), "1")

    def is_cancel_requested(self, job_id: str) -> bool:
        """Whether the job's shards must stop: it was cancelled, or it failed."""
        return bool(self.redis.exists(self._cancel_key(job_id)))

    # -- plan -------------------------------------------------------------------------------

    def save_plan(self, job_id: str, plan: Sequence[ShardPlan]) -> builtins.list[ShardPlan]:
        """Write plan.json once and return the plan that stands: a planner that runs twice gets
        the first plan back, so shard indexes never change under running shards.
        """
        data = StoredPlan(shards=list(plan)).model_dump_json().encode()
        try:
            self.store.put_bytes(self.layout(job_id).plan_key, data, if_none_match=True)
        except AlreadyExists:
            return self.load_plan(job_id)
        return list(plan)

    def load_plan(self, job_id: str) -> builtins.list[ShardPlan]:
        """Raises `ObjectNotFound` when the job has not been planned."""
        return StoredPlan.model_validate_json(self.store.get_bytes(self.layout(job_id).plan_key)).shards

    # -- internals --------------------------------------------------------------------------

    def _record(self, status: JobStatus) -> None:
        member = f"{int(status.created_at.timestamp() * 1_000_000):017d}:{status.job_id}"
        fields = {"state": status.state.value, "created_at": _timestamp(status.created_at),
                  "started_at": _timestamp(status.started_at),
                  "finalizing_at": _timestamp(status.finalizing_at),
                  "finished_at": _timestamp(status.finished_at), "error": status.error or "",
                  "output_uris": json.dumps(status.output_uris), "manifest_uri": status.manifest_uri or "",
                  "tenant": status.tenant or "", "parent_job_id": status.parent_job_id or "",
                  "expires_at": _timestamp(status.expires_at)}
        arguments = [member]
        for name, value in fields.items():
            arguments += [name, value]
        keys = [self._job_key(status.job_id), self._index_key, *(self._state_index_key(s) for s in STATES)]
        self._record_if_absent(keys=keys, args=arguments)
        self.redis.zadd(self._tenant_index_key(status.tenant), {member: 0})  # its tenant's listing
        if status.expires_at is not None and not status.state.is_terminal:  # again after a Redis loss
            register_deadline(self.redis, self.namespace, status.job_id, status.expires_at)
        if status.state == JobState.CANCELLED:
            self.redis.set(self._cancel_key(status.job_id), "1")

    def _restore(self, job_id: str) -> JobStatus:
        """Put a job Redis does not know back from status.json (job.json alone: a create that
        stopped before writing it, so the job is still queued).
        """
        layout = self.layout(job_id)
        if not self.store.exists(layout.spec_key):
            raise JobNotFound(job_id)
        status = self._stored_status(job_id)
        self._record(status)
        raw = self.redis.hgetall(self._job_key(job_id))
        status = self._status_from_hash(job_id, raw) if raw else status
        counts = self._counts(job_id, status.state)
        return status.with_counts(counts.rows, counts.shards, counts.usage) if counts else status

    def _status_from_hash(self, job_id: str, raw: dict[Any, Any]) -> JobStatus:
        fields = {key.decode(): value.decode() for key, value in raw.items()}
        return JobStatus(
            job_id=job_id, state=JobState(fields["state"]), created_at=_datetime(fields["created_at"]),
            started_at=_datetime(fields.get("started_at")), finished_at=_datetime(fields.get("finished_at")),
            finalizing_at=_datetime(fields.get("finalizing_at")),
            error=fields.get("error") or None, output_uris=json.loads(fields.get("output_uris") or "[]"),
            manifest_uri=fields.get("manifest_uri") or None, tenant=fields.get("tenant") or None,
            parent_job_id=fields.get("parent_job_id") or None, expires_at=_datetime(fields.get("expires_at")))

    def _counts(self, job_id: str, state: JobState) -> CounterSnapshot | None:
        """The counts, with the rows running shards have finished while the job has not ended (an
        ended job: its counted shards only); rebuilt from the store when Redis lost them; None
        before planning."""
        counters = self.counters(job_id)
        live = not state.is_terminal
        try:
            return counters.read(live=live)
        except CountersMissing:
            if state == JobState.QUEUED:  # not planned yet (or planning now): nothing to rebuild
                return None
        try:
            plan = self.load_plan(job_id)
        except ObjectNotFound:
            return None
        counters.rebuild_from_store(self.store, self.layout(job_id), plan)
        return counters.read(live=live)

    def _manifest_uris(self, job_id: str) -> tuple[str, str]:
        layout = self.layout(job_id)
        try:
            manifest = read_manifest(self.store, layout)
        except ObjectNotFound:
            return "", ""
        return json.dumps([part.output.uri for part in manifest.parts]), self.store.uri(layout.manifest_key)

    def _write_status(self, job_id: str) -> JobStatus:
        """Write status.json from Redis; again if another transition landed meanwhile, so the
        file ends with the last state whichever writer finishes last.
        """
        layout = self.layout(job_id)
        for _ in range(5):
            status = self.get(job_id)
            self.store.put_bytes(layout.status_key, status.model_dump_json().encode())
            current = self.redis.hget(self._job_key(job_id), "state")
            if current is None or _text(current) == status.state.value:
                return status
        return status


def _text(value: Any) -> str:
    """A member or field as Redis gives it back (bytes: the client does not decode responses)."""
    return value.decode() if isinstance(value, bytes) else str(value)

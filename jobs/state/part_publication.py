"""Fenced shard parts: each run writes its parts under its own fencing token, and only the run whose
result commits (or whoever finds that result later) copies them to the part keys.

Without it, a run that lost its shard lease (stalled past the TTL: a long GC, a paused VM, a slow
disk) could still be streaming its parts when a newer run commits, and overwrite the very parts
the committed result describes. With it, a run writes only under `_temporary/<fence>/` next to
the part (Hadoop's output committers stage the same way), where nothing reads; the part keys are
written from the committed result's staged copies alone, so a stale run can never replace them.
Publishing is idempotent: copy, then drop the staged copy; a later delivery that finds the staged
copy gone checks the part is there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import UTC, datetime

from bulkinfer.jobs.formats.output import OutputRow
from bulkinfer.jobs.formats.parts import write_error_part, write_output_part
from bulkinfer.jobs.layout import JobLayout, output_location
from bulkinfer.jobs.object_store.base import ObjectNotFound, ObjectStore
from bulkinfer.jobs.object_store.factory import store_for_uri
from bulkinfer.jobs.planning.sharding import ShardPlan
from bulkinfer.jobs.spec import JobSpec
from bulkinfer.jobs.state.results import PartFile, ShardResult, save_shard_result

STAGING_DIR = "_temporary"


class PartMissing(RuntimeError):
    """A committed result's part is neither staged nor published (deleted by hand?)."""


def staged_key(key: str, fence: str) -> str:
    """Where the run with fencing token `fence` writes the part that belongs at `key`."""
    folder, _, name = key.rpartition("/")
    staged = f"{STAGING_DIR}/{fence}/{name}"
    return f"{folder}/{staged}" if folder else staged


def staging_prefix(directory: str) -> str:
    """Every run's staged parts for the parts in `directory`."""
    directory = directory.rstrip("/")
    return f"{directory}/{STAGING_DIR}/" if directory else f"{STAGING_DIR}/"


class CommitRefused(Exception):
    """The run's parts were staged, but it may no longer commit (its job ended meanwhile)."""


def write_fenced(job_store: ObjectStore, layout: JobLayout, spec: JobSpec, shard: ShardPlan,
                 outputs: Sequence[OutputRow], *, fence: str, created: int, started_at: datetime,
                 dtype: str | None = None, may_commit: Callable[[], bool] | None = None,
                 embedding_dimension: int | None = None, quantization: str | None = None) -> ShardResult:
    """Stage a shard's parts under `fence` and commit its result (for a resolved spec); returns the
    result that stands: an earlier run's if one committed first, this run's staged parts then
    dropped. Publishing is the caller's next step (`publish_parts`, before counting).
    `CommitRefused`, the staged parts dropped, when `may_commit` says no once they are written."""
    location = output_location(spec, job_store, layout)
    output_key, errors_key = location.part_key(shard.index), layout.error_part_key(shard.index)
    output = write_output_part(location.store, staged_key(output_key, fence), outputs, spec,
                               job_id=layout.job_id, created=created, if_none_match=False,
                               embedding_dimension=embedding_dimension)
    errors = write_error_part(job_store, staged_key(errors_key, fence), outputs, if_none_match=False)
    # The result names the parts' own keys; the fence says where their staged copies are.
    output = output.model_copy(update={"key": output_key, "uri": location.store.uri(output_key)})
    errors = errors.model_copy(update={"key": errors_key, "uri": job_store.uri(errors_key)})
    ours = ShardResult.from_outputs(shard, outputs, output=output, errors=errors, started_at=started_at,
                                    finished_at=datetime.now(UTC), dtype=dtype, fence=fence,
                                    quantization=quantization)
    if may_commit is not None and not may_commit():
        discard_staged(job_store, ours)
        raise CommitRefused(f"job {layout.job_id} shard {shard.index}: not committed")
    standing = save_shard_result(job_store, layout, ours)
    if standing.fence != fence:
        discard_staged(job_store, ours)
    return standing


def part_locations(job_store: ObjectStore, result: ShardResult) -> list[tuple[ObjectStore, str, PartFile]]:
    """(store, key, part) of the result's output part (the job's folder or its `output_uri`) and
    error part (always the job's folder)."""
    output = result.output
    if output.uri == job_store.uri(output.key):
        output_store, output_key = job_store, output.key
    else:
        output_store, output_key = store_for_uri(output.uri)
    return [(output_store, output_key, output), (job_store, result.errors.key, result.errors)]


def publish_parts(job_store: ObjectStore, result: ShardResult) -> None:
    """Copy a committed result's staged parts to their keys and drop the staged copies; safe to
    repeat. A result without a fence wrote its parts in place (nothing to do)."""
    if result.fence is None:
        return
    for store, key, part in part_locations(job_store, result):
        staged = staged_key(key, result.fence)
        try:
            store.copy(staged, key)
        except ObjectNotFound:
            try:  # an earlier delivery published it, then removed the staged copy
                size = store.head(key).size
            except ObjectNotFound:
                size = None
            if size != part.bytes:
                raise PartMissing(f"shard {result.shard_index}: {part.uri} is neither staged nor "
                                  f"published ({size} bytes, the result says {part.bytes})") from None
            continue
        store.delete(staged)


def discard_staged(job_store: ObjectStore, lost: ShardResult) -> None:
    """Drop the staged parts of a run whose result did not commit (another run's did)."""
    if lost.fence is None:
        return
    for store, key, _ in part_locations(job_store, lost):
        store.delete(staged_key(key, lost.fence))


def settle_staged(store: ObjectStore, directory: str, results: list[ShardResult]) -> tuple[int, int]:
    """Before the manifest: publish what is still staged for a committed result (a run committed,
    then died before publishing, and Redis, lost, was rebuilt from the results, so nothing re-ran
    it), and delete what runs that lost their commit staged. One listing of `directory`'s staging
    folder; returns (published, deleted)."""
    prefix, folder = staging_prefix(directory), directory.rstrip("/")
    fences = {key: result.fence for result in results
              for key in (result.output.key, result.errors.key) if result.fence is not None}
    published = deleted = 0
    for info in list(store.list(prefix)):
        fence, _, name = info.key[len(prefix):].partition("/")
        key = f"{folder}/{name}" if folder else name
        if fences.get(key) == fence:
            store.copy(info.key, key)
            published += 1
        else:
            deleted += 1
        store.delete(info.key)
    return published, deleted

"""Where a job may read and write: the job store's own areas, each tenant's rules, and whose
outputs a folder holds.

Every `input_uri`, `output_uri` and schedule `input_prefix` is checked where it really points (a
local path resolved, `..` and links followed), for every caller, admins included:

- The job store's own areas (`<store>/jobs/`, `schedules/`, `models/`, `files/`, `batches/`: other
  jobs' outputs, plans, status, model files, /v1 uploads and batch records) are never an input or
  an output. The one exception is an upload: an `input_uri` naming `<store>/jobs/<id>/input/<name>`
  reads that upload when job `<id>` is the caller's (any job's, for an admin or an open API). An
  `output_uri` or `input_prefix` that holds one of these areas (the store root, say) is refused too.
- With API keys set, a tenant's key reads and writes only (a) under its own folder,
  `<store>/tenants/<tenant>/`, (b) its own uploads, and (c) under the prefixes `tenant_prefixes`
  lists for it (a setting: JSON `{"acme": ["s3://acme-data/", "s3://shared/acme/"], ...}`).
  Admin keys and an open API have no such rule.

Anything else is a 403 naming the rule. The rules themselves are jobs/storage_rules.py's (a worker
applies them to the image locations rows name); this module answers them as HTTP errors. Whatever
the rules, an `output_uri` folder belongs to one
job: the first job to use it writes `<folder>/.bulkinfer-job` (write-once, holding its id), and
another job naming the same folder is refused with 409, so no job's parts are written over another's.
A claim no job stands behind (its submit failed after claiming: the job was never created, or its id
names a job whose own output_uri is elsewhere) is void: the submit releases it, and the next claim
takes a void one over (once per void owner, so two racing claims cannot both win).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from bulkinfer.api.errors import HttpError
from bulkinfer.jobs.object_store.base import AlreadyExists, ObjectNotFound, ObjectStore
from bulkinfer.jobs.storage_rules import (
    Kind,
    LocationProblem,
    StorageRules,
    location_problem,
    store_base,
    tenant_prefixes,
    where,
)

# Names callers import from here, the rules' among them.
__all__ = ["OWNER_MARKER", "UNCREATED_CLAIM_GRACE_S", "Kind", "LocationProblem", "StorageRules",
           "check_location", "claim_output_folder", "release_output_folder", "store_base", "tenant_prefixes",
           "where"]

OWNER_MARKER = ".bulkinfer-job"
# A claim whose job does not exist yet may be a submit between its claim and its create: void only
# when older than any submit takes.
UNCREATED_CLAIM_GRACE_S = 600.0
_RELEASED = "released-"  # a claim's owner after its job's submit released it (never a job id)


def check_location(rules: StorageRules, tenant: str | None, uri: str, field: str, location: str,
                   kind: Kind, upload_owner: Callable[[str], str | None] | None = None) -> None:
    """403 (400 for a malformed location) unless a caller of `tenant` (None: an admin or an open API)
    may use `location` as `field`. `upload_owner(job_id)` gives the tenant of a job whose upload an
    input names (JobNotFound if none).
    """
    problem = location_problem(rules, tenant, uri, field, location, kind, upload_owner)
    if problem is not None:
        raise HttpError(problem.status, problem.message)


def claim_output_folder(store: ObjectStore, folder_key: str, uri: str, job_id: str,
                        related: Callable[[str], bool] = lambda _job_id: False,
                        may_name: Callable[[str], bool] = lambda _job_id: True,
                        backs: Callable[[str, str], bool | None] = lambda _job_id, _folder: True) -> None:
    """Make the folder this job's (or find it already is). 409 when another job has it, when it lies
    inside another job's folder (`related(owner)`: a job this one retries, whose folder holds its
    retries' folders), or when it already holds anything: another job's folder inside it, or files
    whose fate would then be tied to this job's (a finalize cleans up what its runs left there).
    Another job is named only when `may_name(owner)` (the caller may see it): another tenant's job
    id is not for this caller to learn. `backs(owner, folder_key)` says whether the owner's job
    stands behind its claim (True; False: its output is elsewhere; None: no such job), so a claim
    left by a failed submit is void (module doc).
    """
    folder = folder_key.strip("/")
    marker = _marker(folder)
    owner, named_by = _claim(store, marker)
    if owner == job_id:
        return
    if owner is not None and not _void(store, named_by, owner, folder, backs):
        whose = f"job {owner}" if may_name(owner) else "another job"
        raise HttpError(409, f"output_uri {uri!r} already holds the outputs of {whose}; give this "
                             "job a folder of its own")
    for ancestor in _ancestors(folder):
        other, other_named_by = _claim(store, _marker(ancestor))
        if other is not None and other != job_id and not related(other) \
                and not _void(store, other_named_by, other, ancestor, backs):
            whose = f"job {other}" if may_name(other) else "another job"
            raise HttpError(409, f"output_uri {uri!r} is inside {ancestor + '/' if ancestor else 'the root'}"
                                 f", the output folder of {whose}; give this job a folder of its own")
    first = next((info for info in store.list(f"{folder}/" if folder else "")
                  if not _is_claim_file(info.key, folder)), None)
    if first is not None:
        raise HttpError(409, f"output_uri {uri!r} is not empty (it holds {first.key!r}); give this job a "
                             "new, empty folder of its own")
    try:
        if owner is None:
            store.put_bytes(marker, job_id.encode(), if_none_match=True)
        else:  # a void claim: the one claim that takes over from `owner` wins, then names its job
            store.put_bytes(_takeover(marker, owner), job_id.encode(), if_none_match=True)
            store.put_bytes(marker, job_id.encode())
    except AlreadyExists:  # another submit claimed it meanwhile
        claim_output_folder(store, folder_key, uri, job_id, related, may_name, backs)


def release_output_folder(store: ObjectStore, folder_key: str, job_id: str) -> None:
    """Undo this job's claim when its job was not created: recorded as a takeover by nobody, so a
    claim racing to take the folder over (the claim being void) and this release cannot both win."""
    marker = _marker(folder_key.strip("/"))
    if _owner(store, marker) == job_id:
        try:
            store.put_bytes(_takeover(marker, job_id), f"{_RELEASED}{job_id}".encode(), if_none_match=True)
        except AlreadyExists:  # another claim took the folder over first: nothing left to release
            pass


def _void(store: ObjectStore, named_by: str, owner: str, folder: str,
          backs: Callable[[str, str], bool | None]) -> bool:
    """Whether no job stands behind `owner`'s claim of `folder` (a submit that failed after it);
    `named_by`: the object that made it the owner, whose age tells a submit still under way."""
    if owner.startswith(_RELEASED):
        return True
    backed = backs(owner, folder)
    if backed is not None:  # False: the job exists, and its spec (written once) names another folder
        return not backed
    try:
        modified = store.head(named_by).modified
    except ObjectNotFound:
        return True
    return modified is not None and time.time() - modified > UNCREATED_CLAIM_GRACE_S


def _is_claim_file(key: str, folder: str) -> bool:
    """The marker, or a takeover's record, of `folder` itself."""
    parent, _, name = key.rpartition("/")
    return parent == folder and name.startswith(OWNER_MARKER)


def _marker(folder: str) -> str:
    return f"{folder}/{OWNER_MARKER}" if folder else OWNER_MARKER


def _owner(store: ObjectStore, marker: str) -> str | None:
    return _claim(store, marker)[0]


def _claim(store: ObjectStore, marker: str) -> tuple[str | None, str]:
    """The folder's owner and the object that names it. The takeover records decide (write-once);
    the marker is rewritten after a takeover, but a claim that died between the two, or a stale
    rewrite, is followed through the records."""
    try:
        owner = store.get_bytes(marker).decode(errors="replace").strip()
    except ObjectNotFound:
        return None, marker
    named_by, seen = marker, {owner}
    while True:
        record = _takeover(marker, owner)
        try:
            successor = store.get_bytes(record).decode(errors="replace").strip()
        except ObjectNotFound:
            return owner, named_by
        if successor in seen:
            return owner, named_by
        owner, named_by = successor, record
        seen.add(owner)


def _takeover(marker: str, owner: str) -> str:
    return f"{marker}.void-{owner}"


def _ancestors(folder: str) -> list[str]:
    """The folders `folder` lies in, nearest first, down to the root ('')."""
    parts = folder.split("/") if folder else []
    return ["/".join(parts[:end]) for end in range(len(parts) - 1, -1, -1)]

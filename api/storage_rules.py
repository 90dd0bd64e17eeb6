"""Where a tenant's jobs may read and write, and whose outputs a folder holds.

`tenant_prefixes` (a setting: JSON `{"acme": ["s3://acme-data/", "s3://shared/acme/"], ...}`) lists
the prefixes each tenant's `input_uri`, `output_uri` and schedule `input_prefix` must lie under;
anything else is a 403 naming the rule. Unset, there is no such rule (a single team's deployment).
Admin keys and an open API are not limited; files uploaded through the API live in the job's own
folder and need no rule.

Whatever the rules, an `output_uri` folder belongs to one job: the first job to use it writes
`<folder>/.bulkinfer-job` (write-once, holding its id), and another job naming the same folder is
refused with 409, so no job's parts are ever written over another's. Folders inside the job store's
`jobs/` tree (other jobs' own folders) are refused outright.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from api.errors import HttpError
from jobs.object_store.base import AlreadyExists, ObjectStore
from jobs.object_store.factory import split_uri

OWNER_MARKER = ".bulkinfer-job"


def tenant_prefixes(setting: str | None) -> dict[str, list[str]] | None:
    """The parsed setting (every prefix ending in '/', so `s3://acme` never matches `s3://acme-x`)."""
    if not setting:
        return None
    try:
        rules = json.loads(setting)
    except ValueError as error:
        raise HttpError(500, f"the tenant_prefixes setting is not JSON: {error}") from None
    if not isinstance(rules, dict) or not all(isinstance(v, list) for v in rules.values()):
        raise HttpError(500, "the tenant_prefixes setting must be a JSON object of tenant → list of prefixes")
    return {tenant: [p if p.endswith("/") else p + "/" for p in map(str, prefixes)]
            for tenant, prefixes in rules.items()}


def canonical_uri(uri: str) -> str:
    """The URI as the stores will read it (`s3://bucket/key`, or `/path` for the `file://` forms and
    their percent-escapes), so a rule compares what is read, not how it was spelled. ValueError for a
    `.` or `..` segment: `<acme's folder>/../globex/x` starts with acme's prefix, and a local store
    (or an S3 client that tidies paths) reads globex's file."""
    scheme, bucket, key = split_uri(uri)
    if {".", ".."} & set(key.split("/")):
        raise ValueError(f"{uri!r} has a '.' or '..' segment; name the object by its own path")
    return f"s3://{bucket}/{key}" if scheme == "s3" else "/" + key


def check_allowed(setting: str | None, tenant: str | None, uri: str, field: str, *,
                  listing: bool = False) -> None:
    """403 unless `tenant` may use `uri` (None: an admin or an open API, never limited). A `listing`
    URI (a schedule's input_prefix) lists every key that starts with it, so it must lie inside an
    allowed folder: `s3://b/acme` would list `s3://b/acme-evil/` too."""
    rules = tenant_prefixes(setting)
    if rules is None or tenant is None:
        return
    allowed = rules.get(tenant, [])
    try:
        wanted = canonical_uri(uri)
        folders = [canonical_uri(prefix) for prefix in allowed]  # each ends in "/"
    except ValueError as error:
        raise HttpError(400, f"{field}: {error}") from None
    if listing and wanted + "/" in folders:
        raise HttpError(400, f"{field} {uri!r}: end it with '/' (without it, it also lists the folders "
                             "beside it whose names start the same)")
    if not any(wanted + "/" == folder or wanted.startswith(folder) for folder in folders):
        names = ", ".join(allowed) or "none: upload files instead"
        raise HttpError(403, f"{field} {uri!r} is outside the prefixes tenant {tenant!r} may use ({names}); "
                            "the deployment's tenant_prefixes setting says where each tenant's data may be")


def claim_output_folder(store: ObjectStore, folder_key: str, uri: str, job_id: str,
                        may_name: Callable[[str], bool] = lambda _owner: True) -> None:
    """Make the folder this job's (or find it already is); 409 when another job has it. The owning
    job is named only when `may_name(owner)` (the caller may see it): another tenant's job id is
    not for this caller to learn."""
    marker = f"{folder_key.rstrip('/')}/{OWNER_MARKER}" if folder_key.strip("/") else OWNER_MARKER
    try:
        store.put_bytes(marker, job_id.encode(), if_none_match=True)
    except AlreadyExists:
        owner = store.get_bytes(marker).decode(errors="replace").strip()
        if owner != job_id:
            whose = f"job {owner}" if may_name(owner) else "another job"
            raise HttpError(409, f"output_uri {uri!r} already holds the outputs of {whose}; give this "
                                "job a folder of its own") from None

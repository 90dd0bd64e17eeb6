"""Where a job may read and write, as pure rules: the job store's own areas, each tenant's prefixes,
and local paths inside a local job store. The API applies them to `input_uri`, `output_uri` and
schedule `input_prefix` (api/storage_rules.py turns a problem into its HTTP error); a worker applies
the same rules to every location a row names (jobs/image_rules.py).

- The job store's own areas (`<store>/jobs/`, `schedules/`, `models/`, `files/`, `batches/`, `kv/`)
  are never an input or an output, except an upload (`<store>/jobs/<id>/input/<name>`) of one of the
  caller's own jobs.
- A tenant (with API keys set) reads and writes only under its own folder, `<store>/tenants/<tenant>/`,
  and the prefixes the `tenant_prefixes` setting lists for it. No tenant (an admin or an open API):
  no such rule.
- A local path is readable only in a deployment whose job store is a local directory, and only
  inside that directory (where the workers read).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from bulkinfer.jobs.layout import KV_STORE_AREA, STORE_AREAS, TENANTS_FOLDER
from bulkinfer.jobs.object_store.base import ObjectStore
from bulkinfer.jobs.tenant_prefixes import tenant_prefixes

if TYPE_CHECKING:
    from bulkinfer.jobs.settings import Settings

_NO_JOB = "\0no job"  # never a tenant's name
# object: a file (input_uri); folder: a directory of parts (output_uri); prefix: a listing's literal
# prefix (input_prefix), which also covers names that merely begin with it ("in" lists "inputs/").
Kind = Literal["object", "folder", "prefix"]


@dataclass(frozen=True)
class LocationProblem:
    """Why a location may not be used: `status` as the API answers it (400 or 403) and the message."""

    status: int
    message: str


def where(store: ObjectStore, key: str) -> str:
    """One comparable string for (store, key): `s3://bucket/key`, or a local key's absolute path
    (a local key from `submission.locate` is already resolved)."""
    from bulkinfer.jobs.object_store.local import LocalObjectStore

    if isinstance(store, LocalObjectStore):
        return (store.root / key).as_posix() if key else store.root.as_posix()
    return store.uri(key)


def store_base(settings: Settings) -> str:
    """The job store, in the form `where` gives, ending in '/'."""
    return _store_root(settings.store_uri)


def _store_root(uri: str) -> str:
    if not uri.startswith("s3://"):
        return Path(uri.removeprefix("file://")).expanduser().resolve().as_posix().rstrip("/") + "/"
    bucket, _, prefix = uri[len("s3://"):].partition("/")
    prefix = prefix.strip("/")
    return f"s3://{bucket}/{prefix}/" if prefix else f"s3://{bucket}/"


@dataclass(frozen=True)
class StorageRules:
    base: str  # the job store, ending in '/'
    prefixes: dict[str, list[str]] | None  # tenant_prefixes, parsed
    kv_base: str | None = None  # the prefix KV store (kv_store_uri) when it is not the job store

    @classmethod
    def of(cls, settings: Settings) -> StorageRules:
        kv_base = _store_root(settings.kv_store_uri) if settings.kv_store_uri else None
        return cls(store_base(settings), tenant_prefixes(settings.tenant_prefixes), kv_base)

    def area(self, location: str, kind: Kind) -> str | None:
        """The store area `location` lies in, or (a folder or prefix) holds; None when neither."""
        areas = [(name, f"{self.base}{name}/") for name in STORE_AREAS]
        if self.kv_base is not None:  # every tenant's prefix KV blocks, wherever they are kept
            areas.append((KV_STORE_AREA, f"{self.kv_base}{KV_STORE_AREA}/"))
        for name, area in areas:
            if (location.rstrip("/") + "/").startswith(area):
                return name
            holder = location if kind == "prefix" else location.rstrip("/") + "/"
            if kind != "object" and area.startswith(holder):
                return name
        return None

    def upload_job(self, location: str) -> str | None:
        """The job whose upload `location` is (`<store>/jobs/<id>/input/<name>`), if it is one."""
        jobs = f"{self.base}jobs/"
        if not location.startswith(jobs):
            return None
        parts = location[len(jobs):].split("/")
        return parts[0] if len(parts) == 3 and parts[1] == "input" and parts[0] and parts[2] else None

    def allowed(self, tenant: str) -> list[str]:
        """Where a tenant's key may read and write (besides its uploads)."""
        return [f"{self.base}{TENANTS_FOLDER}/{tenant}/", *(self.prefixes or {}).get(tenant, [])]


def location_problem(rules: StorageRules, tenant: str | None, uri: str, field: str, location: str,
                     kind: Kind, upload_owner: Callable[[str], str | None] | None = None
                     ) -> LocationProblem | None:
    """Why a caller of `tenant` (None: an admin or an open API) may not use `location` as `field`
    (None: it may). `upload_owner(job_id)` gives the tenant of a job whose upload an input names
    (LookupError or ValueError if none); without it no upload is readable."""
    named = f"{field} {uri!r}"
    if location.startswith("s3://") and {".", ".."} & set(location[len("s3://"):].split("/")[1:]):
        # `<acme's folder>/../globex/x` starts with acme's prefix, and an S3 client that tidies
        # paths (or a proxy) reads globex's object.
        return LocationProblem(400, f"{named} has a '.' or '..' segment; name the object by its own path")
    job_id = rules.upload_job(location) if kind == "object" else None
    if job_id is not None and upload_owner is not None:
        try:
            owner = upload_owner(job_id)
        except (LookupError, ValueError):  # no such job (or not a job id)
            owner = _NO_JOB
        if owner != _NO_JOB and (tenant is None or owner == tenant):
            return None
        return LocationProblem(403, f"{named} is inside the job store's jobs/ folder; of what is there, only "
                                    "the upload of one of your own jobs may be read")
    area = rules.area(location, kind)
    if area is not None:
        return LocationProblem(403, f"{named} is inside or holds the job store's {area}/ folder, where the "
                                    "service keeps its own files (jobs' outputs and state, schedules, model "
                                    "files, /v1 files and batches, prefix KV blocks): it is no job's input "
                                    "or output")
    if tenant is None:
        return None
    allowed = rules.allowed(tenant)
    if kind == "prefix" and location + "/" in allowed:
        return LocationProblem(400, f"{named}: end it with '/' (without it, it also lists the folders beside "
                                    "it whose names start the same)")
    if not any(location.startswith(prefix) or location + "/" == prefix for prefix in allowed):
        return LocationProblem(403, f"{named} is outside the prefixes tenant {tenant!r} may use "
                                    f"({', '.join(allowed)}; and its own uploads); the deployment's "
                                    "tenant_prefixes setting says where else each tenant's data may be")
    return None


def local_path_problem(settings: Settings, uri: str, field: str, key: str) -> tuple[Path | None, str | None]:
    """(the resolved path, None) when a local path (`key`: split_uri's) lies in this deployment's
    local job store, which is what the workers can read; else (None, why not)."""
    if not settings.is_local_store:
        return None, (f"{field} {uri!r} is a local path, but this deployment keeps jobs in S3, where its "
                      "workers read them; use an s3:// URI or upload the file")
    root = settings.local_store_root()
    path = Path("/", key).resolve()
    if path != root and root not in path.parents:
        return None, (f"{field} {uri!r} is outside the store directory (the one the store_uri setting "
                      "names); put the file there, or upload it")
    return path, None

"""Which image locations a job's rows may name: the tenant rules of `input_uri`, applied by the
worker to every `s3://`, `file://` or path image a row gives (jobs/storage_rules.py says the rules).

A job's tenant is its spec's `tenant` (the API sets it from the caller's key; None for an admin or
an open API, who are bound only by the store-area rules). `data:` and `http(s)://` images are not
store locations: the image fetcher bounds those by itself (`image_http_hosts`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from bulkinfer.jobs.object_store.factory import split_uri
from bulkinfer.jobs.storage_rules import StorageRules, local_path_problem, location_problem

if TYPE_CHECKING:
    from bulkinfer.jobs.settings import Settings

FIELD = "image location"
# Why a location may not be read (None: it may): what the image fetcher calls for each store location.
MayRead = Callable[[str], str | None]


def image_read_rule(settings: Settings, tenant: str | None,
                    upload_owner: Callable[[str], str | None] | None = None) -> MayRead:
    """The rule for one job's image locations: the deployment's `settings` (its store and
    `tenant_prefixes`), the job's `tenant`. `upload_owner(job_id)` gives the tenant of a job (to let
    a row name one of its tenant's uploads, as input_uri may); without it no upload is readable."""
    rules = StorageRules.of(settings)

    def may_read(url: str) -> str | None:
        try:
            scheme, bucket, key = split_uri(url)
        except ValueError as error:
            return f"{FIELD} {url!r}: {error}"
        if scheme == "s3":
            location = f"s3://{bucket}/{key}"
        else:
            path, problem = local_path_problem(settings, url, FIELD, key)
            if path is None:
                return problem
            location = path.as_posix()
        refused = location_problem(rules, tenant, url, FIELD, location, "object", upload_owner)
        return None if refused is None else refused.message

    return may_read

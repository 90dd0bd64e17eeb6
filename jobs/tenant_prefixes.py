"""The `tenant_prefixes` setting parsed: `{tenant: [prefixes]}`, each prefix canonical (an `s3://`
bucket and key, or a resolved local path) and ending in '/'. Its own module: the settings check it at
start, and the storage rules (jobs/storage_rules.py) apply it."""

from __future__ import annotations

import json
from pathlib import Path

from bulkinfer.jobs.object_store.factory import split_uri


class BadTenantPrefixes(ValueError):
    """The `tenant_prefixes` setting cannot be parsed."""


def tenant_prefixes(setting: str | None) -> dict[str, list[str]] | None:
    """The parsed setting, each prefix in the form `where` gives (a local one resolved) and ending
    in '/', so `s3://acme` never matches `s3://acme-x`. Raises `BadTenantPrefixes`."""
    if not setting:
        return None
    try:
        rules = json.loads(setting)
    except ValueError as error:
        raise BadTenantPrefixes(f"the tenant_prefixes setting is not JSON: {error}") from None
    if not isinstance(rules, dict) or not all(isinstance(v, list) for v in rules.values()):
        raise BadTenantPrefixes("the tenant_prefixes setting must be a JSON object of tenant → list of "
                                "prefixes")
    return {tenant: [_canonical_prefix(str(p)) for p in prefixes] for tenant, prefixes in rules.items()}


def _canonical_prefix(prefix: str) -> str:
    try:
        scheme, bucket, key = split_uri(prefix)
    except ValueError as error:
        raise BadTenantPrefixes(f"the tenant_prefixes setting: {error}") from None
    if scheme == "s3":
        return f"s3://{bucket}/{key}".rstrip("/") + "/"
    return Path("/", key).resolve().as_posix().rstrip("/") + "/"

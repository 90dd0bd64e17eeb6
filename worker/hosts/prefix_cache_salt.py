"""Which requests may share prefix-cache blocks: those of one tenant, unless the deployment says all.

Every output row reports `cached_tokens`, so a shared cache tells a tenant whether some other tenant
sent the same prefix recently (a timing-free side channel, and a cheaper prompt for the second
sender). The engine hashes a request's salt into its first block's hash (engine/kv_cache_manager.py),
so requests with different salts never find each other's blocks.
"""

from __future__ import annotations

from bulkinfer.jobs.names import NO_TENANT

SALT_PREFIX = "tenant:"


def prefix_cache_salt(tenant: str | None, share_across_tenants: bool = False) -> str | None:
    """The cache salt for a job's rows: its tenant's (jobs without a tenant share one), or None
    (unsalted, one cache for everyone) when the deployment shares the cache across tenants."""
    if share_across_tenants:
        return None
    return SALT_PREFIX + (tenant or NO_TENANT)

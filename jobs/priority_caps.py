"""Which priorities a tenant may give its jobs: the deployment's, not the user's, choice.

Priority is strict, in the fair queue (a free worker takes the highest priority waiting) and inside
the engine, so a tenant free to set 9 would run ahead of every other tenant's jobs for as long as it
kept submitting. `tenant_max_priority` ({tenant: highest}) names the tenants allowed more (or less)
than `default_tenant_max_priority` (default 5, `normal`): out of the box every tenant may submit
`normal` or lower, and the fair share between tenants decides the rest.

The API refuses a job or schedule that asks for more (403 naming the rule), so nobody believes
their job runs `high` when it does not. Jobs the API did not check at today's settings (a schedule's
jobs, a retry, a job queued before the cap was lowered) run at the cap: workers clamp. Jobs without a
tenant (an admin key's, or any on an open API, which is for a trusted network) are not limited.
"""

from __future__ import annotations

import json

from bulkinfer.jobs.spec import PRIORITY_NAMES, JobSpec

DEFAULT_TENANT_MAX_PRIORITY = PRIORITY_NAMES["normal"]


def parse_tenant_max_priority(setting: str | None) -> dict[str, int]:
    """{tenant: highest priority}; raises ValueError naming what is wrong."""
    if not setting:
        return {}
    try:
        caps = json.loads(setting)
    except json.JSONDecodeError as error:
        raise ValueError(f"not JSON ({error.msg})") from None
    if not isinstance(caps, dict):
        raise ValueError('must be a JSON object {"tenant": highest priority 0-9}')
    for tenant, cap in caps.items():
        if isinstance(cap, bool) or not isinstance(cap, int) or not 0 <= cap <= 9:
            raise ValueError(f"tenant {tenant!r}: the highest priority must be an integer 0-9, got {cap!r}")
    return caps


def max_priority(caps: dict[str, int], default: int, tenant: str | None) -> int | None:
    """The highest priority `tenant` may use (None: not limited)."""
    if tenant is None:
        return None
    return caps.get(tenant, default)


def priority_problem(caps: dict[str, int], default: int, tenant: str | None, priority: int) -> str | None:
    """Why `tenant` may not ask for `priority`, or None when it may."""
    highest = max_priority(caps, default, tenant)
    if highest is None or priority <= highest:
        return None
    return (f"priority {priority} is above the highest tenant {tenant!r} may use ({highest}); the "
            "deployment's tenant_max_priority setting says which priorities each tenant may use")


def effective_priority(caps: dict[str, int], default: int, spec: JobSpec) -> int:
    """The priority the job's shards run at: its own, capped for its tenant."""
    highest = max_priority(caps, default, spec.tenant)
    return spec.priority if highest is None else min(spec.priority, highest)

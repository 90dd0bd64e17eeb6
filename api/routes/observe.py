"""What the deployment is doing: Prometheus metrics, live workers, a job's progress, the status page."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

from fastapi import APIRouter, Request, Response
from fastapi.responses import HTMLResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from bulkinfer.api.auth import CallerDep
from bulkinfer.api.dependencies import Context
from bulkinfer.api.errors import HttpError
from bulkinfer.api.routes.jobs import owned_job
from bulkinfer.api.schemas import ERROR_RESPONSES, WorkerList
from bulkinfer.jobs.state.progress import JobProgress, job_progress
from bulkinfer.jobs.state.usage import UsageReport, usage_report
from bulkinfer.jobs.workers import anonymous, live_workers

router = APIRouter(tags=["observe"], responses=ERROR_RESPONSES)
DEFAULT_USAGE_DAYS = 30
STATUS_PAGE = Path(__file__).resolve().parents[1] / "ui" / "index.html"


@router.get("/metrics", summary="Prometheus metrics of the service", response_class=Response,
            responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
def metrics(request: Request, caller: CallerDep) -> Response:
    """Jobs by status, queue lengths, live workers. With API keys set, an admin key's: the figures
    span every tenant."""
    if request.app.state.auth.enabled and not caller.admin:
        raise HttpError(403, "/metrics spans every tenant: it needs an admin key (admin_api_keys)")
    return Response(generate_latest(request.app.state.metrics), media_type=CONTENT_TYPE_LATEST)


@router.get("/workers", response_model=WorkerList, summary="Live workers: models, dtype, throughput")
def workers(context: Context, caller: CallerDep) -> WorkerList:
    """Every live worker's models, state and load. Hostnames and pids are the operator's: an admin
    key (or an open API) sees them; a tenant's key sees each worker as `worker-<n>`, without a pid."""
    repository = context.repository
    beats = live_workers(repository.redis, repository.namespace)
    return WorkerList(workers=beats if caller.admin else anonymous(beats))


@router.get("/usage", response_model=UsageReport,
            summary="Rows, tokens and engine seconds per tenant and model")
def usage(context: Context, caller: CallerDep, since: datetime | None = None, until: datetime | None = None,
          tenant: str | None = None, model: str | None = None) -> UsageReport:
    """What shards counted in [since, until) used (by the hour; default: the last 30 days), per tenant
    and model: rows, failed and deduplicated rows, tokens (prompt, cached, completion) and the engine
    seconds attributed to them. A tenant's key sees its own tenant only; an admin key every tenant's
    (or one, with `tenant`)."""
    if caller.scope is not None:
        if tenant is not None and tenant != caller.scope:
            raise HttpError(403, f"this key belongs to tenant {caller.scope!r}: it sees that tenant's usage "
                                 "only")
        tenant = caller.scope
    until = _aware(until) or datetime.now(UTC)
    since = _aware(since) or until - timedelta(days=DEFAULT_USAGE_DAYS)
    repository = context.repository
    try:
        return usage_report(repository.redis, repository.namespace, since, until, tenant=tenant, model=model)
    except ValueError as error:
        raise HttpError(422, str(error)) from None


def _aware(value: datetime | None) -> datetime | None:
    return value.replace(tzinfo=UTC) if value is not None and value.tzinfo is None else value


@router.get("/jobs/{job_id}/progress", response_model=JobProgress, tags=["jobs"],
            summary="A job's rows and tokens over time, and its errors by code")
def progress(job_id: str, context: Context, caller: CallerDep) -> JobProgress:
    owned_job(context, caller, job_id)
    return job_progress(context.store, context.repository.layout(job_id))


@router.get("/ui", response_class=HTMLResponse, include_in_schema=False)
def status_page() -> HTMLResponse:
    """The status page: a static shell (no data in it) whose script reads the API with the key the
    user enters, so with keys set it shows only what that key may see."""
    return HTMLResponse(STATUS_PAGE.read_text(encoding="utf-8"))

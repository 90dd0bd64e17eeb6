"""The schedule routes: create, list, read, pause, resume, delete, tick now, and what was submitted.

A schedule submits one job per new object under its input prefix each time its cron fires (the
workers' ticker) or `POST /schedules/{id}/tick` is called (docs/schedules-and-webhooks.md).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Response
from pydantic import BaseModel

from bulkinfer.api.auth import Caller, CallerDep
from bulkinfer.api.dependencies import ApiContext, Context
from bulkinfer.api.dispatch import enqueue_plan
from bulkinfer.api.errors import HttpError
from bulkinfer.api.schemas import ERROR_RESPONSES
from bulkinfer.api.submission import (
    check_completion_window,
    check_lora,
    check_priority,
    check_webhook,
    check_where,
    locate,
    parse_object,
)
from bulkinfer.jobs.object_store.factory import split_uri
from bulkinfer.jobs.scheduling.schedule_tick import tick_schedule
from bulkinfer.jobs.scheduling.schedules import (
    TEMPLATE_PROBE_URI,
    Schedule,
    ScheduleNotFound,
    ScheduleRepository,
    ScheduleSpec,
    ScheduleUnreadable,
    ScheduleView,
    SubmittedObject,
    TickReport,
    split_input,
)
from bulkinfer.jobs.spec import JobSpec

router = APIRouter(tags=["schedules"], responses=ERROR_RESPONSES)


class ScheduleList(BaseModel):
    schedules: list[ScheduleView]


class SubmittedList(BaseModel):
    objects: list[SubmittedObject]


def _repository(context: ApiContext) -> ScheduleRepository:
    return ScheduleRepository.beside(context.repository)


def _check_input(context: ApiContext, spec: ScheduleSpec) -> None:
    """The prefix must be listable by the workers, where the caller may read, and hold none of the
    job store's own folders (a schedule over its own outputs would submit jobs forever).
    """
    base, _ = split_input(spec.input_prefix)
    scheme, bucket, key = split_uri(base)
    if scheme == "s3":
        store = context.s3_store(bucket)
    else:  # inside the local store, else 400
        store, resolved = locate(context, "/" + key if key else "/", "input_prefix")
        key = resolved + "/" if key.endswith("/") or not key else resolved
    check_where(context, spec.tenant, spec.input_prefix, "input_prefix", store, key, "prefix")
    if scheme == "s3":
        try:
            next(iter(store.list(key)), None)
        except Exception as error:  # noqa: BLE001 - S3 says why (no bucket, denied, unreachable)
            raise HttpError(400, f"input_prefix {spec.input_prefix}: cannot list it ({error})") from None


# The body is parsed by hand (errors phrased as for a JobSpec); its schema is published here.
CREATE_BODY = {"required": True,
               "content": {"application/json": {"schema": ScheduleSpec.model_json_schema()}}}


@router.post("/schedules", status_code=201, response_model=ScheduleView, summary="Create a schedule",
             openapi_extra={"requestBody": CREATE_BODY})
def create_schedule(body: Annotated[dict[str, Any], Body()], context: Context,
                    caller: CallerDep) -> ScheduleView:
    """A cron expression (UTC; 6 fields = seconds last), an input prefix or glob, and a job template
    (a JobSpec without `input_uri` and `idempotency_key`). A bad cron or template answers 422
    naming the field; an unknown model or an unreadable prefix 400.
    """
    spec = parse_object(body, ScheduleSpec, "schedule")
    template = {name: value for name, value in spec.job.items() if name != "tenant"}  # each tick sets it
    # An alias: its ticks' jobs run the served model it names (UnknownModel: 400 naming both).
    template["model"] = context.registry.resolve(template["model"])
    spec = spec.model_copy(update={"tenant": caller.tenant, "job": template})
    check_webhook(context, spec.webhook_url)
    check_webhook(context, spec.job.get("webhook_url"))
    # Every job a tick submits is held to the limits a POST /jobs is held to.
    probe = JobSpec.model_validate({**spec.job, "input_uri": TEMPLATE_PROBE_URI})
    check_priority(context, spec.tenant, probe.priority)
    check_completion_window(context, probe)
    check_lora(context, probe.model_copy(update={"tenant": spec.tenant}))  # its ticks' jobs skip POST /jobs
    _check_input(context, spec)
    schedules = _repository(context)
    return schedules.view(schedules.create(spec))


@router.get("/schedules", response_model=ScheduleList, summary="List schedules, oldest first")
def list_schedules(context: Context, caller: CallerDep) -> ScheduleList:
    """The caller's tenant's schedules (an admin key: every tenant's)."""
    schedules = _repository(context)
    return ScheduleList(schedules=[schedules.view(schedule) for schedule in schedules.list()
                                   if caller.sees(schedule.tenant)])


def _owned(context: ApiContext, caller: Caller, schedule_id: str) -> Schedule:
    """The schedule, if the caller may see it; another tenant's is not found, as if it did not exist.
    One that no longer reads is a 409 for its owner (who may delete it)."""
    try:
        schedule = _repository(context).get(schedule_id)
    except ScheduleUnreadable as unreadable:
        if not caller.sees(unreadable.tenant):
            raise ScheduleNotFound(schedule_id) from None
        raise HttpError(409, str(unreadable)) from None
    if not caller.sees(schedule.tenant):
        raise ScheduleNotFound(schedule_id)
    return schedule


@router.get("/schedules/{schedule_id}", response_model=ScheduleView, summary="A schedule and its tick state")
def get_schedule(schedule_id: str, context: Context, caller: CallerDep) -> ScheduleView:
    return _repository(context).view(_owned(context, caller, schedule_id))


def _set_paused(context: ApiContext, caller: Caller, schedule_id: str, paused: bool) -> ScheduleView:
    _owned(context, caller, schedule_id)
    schedules = _repository(context)
    return schedules.view(schedules.set_paused(schedule_id, paused))


@router.post("/schedules/{schedule_id}/pause", response_model=ScheduleView, summary="Pause a schedule")
def pause_schedule(schedule_id: str, context: Context, caller: CallerDep) -> ScheduleView:
    """No tick submits anything while paused; objects that arrive meanwhile are submitted after resume."""
    return _set_paused(context, caller, schedule_id, True)


@router.post("/schedules/{schedule_id}/resume", response_model=ScheduleView, summary="Resume a schedule")
def resume_schedule(schedule_id: str, context: Context, caller: CallerDep) -> ScheduleView:
    return _set_paused(context, caller, schedule_id, False)


@router.delete("/schedules/{schedule_id}", status_code=204, summary="Delete a schedule")
def delete_schedule(schedule_id: str, context: Context, caller: CallerDep) -> Response:
    """The jobs it submitted stay. One that no longer reads may be deleted by its owner."""
    try:
        _owned(context, caller, schedule_id)
    except HttpError as error:
        if error.status_code != 409:
            raise
    _repository(context).delete(schedule_id)
    return Response(status_code=204)


@router.post("/schedules/{schedule_id}/tick", response_model=TickReport, summary="Tick a schedule now")
def tick_now(schedule_id: str, context: Context, caller: CallerDep) -> TickReport:
    """Submit the schedule's new objects now, whatever its cron says (paused: 409)."""
    schedules = _repository(context)
    schedule = _owned(context, caller, schedule_id)
    if schedule.paused:
        raise HttpError(409, f"schedule {schedule_id} is paused; resume it first")
    result = tick_schedule(schedules, context.repository, schedule,
                           lambda job_id: enqueue_plan(context.tasks, job_id),
                           endpoint_url=context.settings.s3_endpoint_url,
                           max_jobs_in_flight=context.settings.max_jobs_in_flight)
    return TickReport(schedule_id=schedule_id, submitted=result.submitted, error=result.error,
                      deferred=result.deferred)


@router.get("/schedules/{schedule_id}/jobs", response_model=SubmittedList,
            summary="The objects a schedule has submitted, with their jobs")
def submitted_objects(schedule_id: str, context: Context, caller: CallerDep) -> SubmittedList:
    schedules = _repository(context)
    _owned(context, caller, schedule_id)  # 404 for an unknown schedule, or another tenant's
    return SubmittedList(objects=schedules.submitted(schedule_id))

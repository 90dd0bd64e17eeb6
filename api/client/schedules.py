"""`client.schedules` (sync) and `async_client.schedules` (async): scheduled ETL over an input prefix.

    schedule = client.schedules.create(cron="*/10 * * * *", input_prefix="s3://bucket/incoming/*.jsonl",
                                       job={"model": "small", "prompt_column": "q"},
                                       webhook_url="https://example.com/hooks/bulkinfer")
    client.schedules.tick(schedule)      # submit new objects now, whatever the cron says
    client.schedules.pause(schedule); client.schedules.resume(schedule); client.schedules.delete(schedule)

Each new object (key + ETag) under the prefix gets exactly one job (docs/schedules-and-webhooks.md).
"""

from __future__ import annotations

import builtins
from collections.abc import Mapping
from typing import Any

from bulkinfer.api.client.jobs import spec_body
from bulkinfer.api.client.transport import AsyncTransport, Transport
from bulkinfer.jobs.scheduling.schedules import ScheduleSpec, ScheduleView, SubmittedObject, TickReport

ScheduleRef = str | ScheduleView  # a schedule id, or a schedule the client returned


def schedule_id_of(schedule: ScheduleRef) -> str:
    return schedule.id if isinstance(schedule, ScheduleView) else str(schedule)


class Schedules:
    def __init__(self, transport: Transport) -> None:
        self._transport = transport

    def create(self, spec: ScheduleSpec | Mapping[str, Any] | None = None, *, cron: str | None = None,
               input_prefix: str | None = None, job: Mapping[str, Any] | None = None, name: str | None = None,
               webhook_url: str | None = None, paused: bool | None = None) -> ScheduleView:
        """A new schedule; keyword fields override `spec`'s. `ApiError` 422 names a bad field."""
        body = spec_body(spec, {"cron": cron, "input_prefix": input_prefix, "job": job, "name": name,
                                "webhook_url": webhook_url, "paused": paused})
        response = self._transport.request("POST", "/schedules", json=body, idempotent=False)
        return ScheduleView.model_validate(response.json())

    def list(self) -> list[ScheduleView]:
        response = self._transport.request("GET", "/schedules", idempotent=True)
        return [ScheduleView.model_validate(item) for item in response.json()["schedules"]]

    def get(self, schedule: ScheduleRef) -> ScheduleView:
        response = self._transport.request("GET", f"/schedules/{schedule_id_of(schedule)}", idempotent=True)
        return ScheduleView.model_validate(response.json())

    def pause(self, schedule: ScheduleRef) -> ScheduleView:
        return self._action(schedule, "pause")

    def resume(self, schedule: ScheduleRef) -> ScheduleView:
        return self._action(schedule, "resume")

    def _action(self, schedule: ScheduleRef, action: str) -> ScheduleView:
        path = f"/schedules/{schedule_id_of(schedule)}/{action}"
        return ScheduleView.model_validate(self._transport.request("POST", path, idempotent=True).json())

    def delete(self, schedule: ScheduleRef) -> None:
        self._transport.request("DELETE", f"/schedules/{schedule_id_of(schedule)}", idempotent=False)

    def tick(self, schedule: ScheduleRef) -> TickReport:
        """Submit the schedule's new objects now (a repeated tick never submits one twice)."""
        path = f"/schedules/{schedule_id_of(schedule)}/tick"
        return TickReport.model_validate(self._transport.request("POST", path, idempotent=True).json())

    def submitted(self, schedule: ScheduleRef) -> builtins.list[SubmittedObject]:
        """The objects the schedule has submitted, with their job ids, oldest first."""
        path = f"/schedules/{schedule_id_of(schedule)}/jobs"
        objects = self._transport.request("GET", path, idempotent=True).json()["objects"]
        return [SubmittedObject.model_validate(item) for item in objects]


class AsyncSchedules:
    def __init__(self, transport: AsyncTransport) -> None:
        self._transport = transport

    async def create(self, spec: ScheduleSpec | Mapping[str, Any] | None = None, *, cron: str | None = None,
                     input_prefix: str | None = None, job: Mapping[str, Any] | None = None,
                     name: str | None = None, webhook_url: str | None = None,
                     paused: bool | None = None) -> ScheduleView:
        body = spec_body(spec, {"cron": cron, "input_prefix": input_prefix, "job": job, "name": name,
                                "webhook_url": webhook_url, "paused": paused})
        response = await self._transport.request("POST", "/schedules", json=body, idempotent=False)
        return ScheduleView.model_validate(response.json())

    async def list(self) -> list[ScheduleView]:
        response = await self._transport.request("GET", "/schedules", idempotent=True)
        return [ScheduleView.model_validate(item) for item in response.json()["schedules"]]

    async def get(self, schedule: ScheduleRef) -> ScheduleView:
        path = f"/schedules/{schedule_id_of(schedule)}"
        response = await self._transport.request("GET", path, idempotent=True)
        return ScheduleView.model_validate(response.json())

    async def pause(self, schedule: ScheduleRef) -> ScheduleView:
        return await self._action(schedule, "pause")

    async def resume(self, schedule: ScheduleRef) -> ScheduleView:
        return await self._action(schedule, "resume")

    async def _action(self, schedule: ScheduleRef, action: str) -> ScheduleView:
        path = f"/schedules/{schedule_id_of(schedule)}/{action}"
        response = await self._transport.request("POST", path, idempotent=True)
        return ScheduleView.model_validate(response.json())

    async def delete(self, schedule: ScheduleRef) -> None:
        await self._transport.request("DELETE", f"/schedules/{schedule_id_of(schedule)}", idempotent=False)

    async def tick(self, schedule: ScheduleRef) -> TickReport:
        path = f"/schedules/{schedule_id_of(schedule)}/tick"
        response = await self._transport.request("POST", path, idempotent=True)
        return TickReport.model_validate(response.json())

    async def submitted(self, schedule: ScheduleRef) -> builtins.list[SubmittedObject]:
        path = f"/schedules/{schedule_id_of(schedule)}/jobs"
        objects = (await self._transport.request("GET", path, idempotent=True)).json()["objects"]
        return [SubmittedObject.model_validate(item) for item in objects]

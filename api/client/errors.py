"""What the SDK raises: `ApiError` for a refusal from the server, `WaitTimeout` when a wait runs out."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bulkinfer.jobs.state.status import JobStatus


class ApiError(Exception):
    """The server refused a request: `status_code`, its `message`, and one line per problem."""

    def __init__(self, status_code: int, message: str, messages: list[str] | None = None) -> None:
        super().__init__(f"{status_code}: {message}")
        self.status_code = status_code
        self.message = message
        self.messages = messages or []


class WaitTimeout(TimeoutError):
    """`jobs.wait` ran out of time; `status` is the job as last seen (still not finished)."""

    def __init__(self, status: JobStatus, timeout: float) -> None:
        super().__init__(f"job {status.job_id} is still {status.state.value} after {timeout:g}s")
        self.status = status
        self.timeout = timeout

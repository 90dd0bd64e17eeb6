"""Errors the API returns: one JSON shape, `{"detail": message, "messages": [...]}`, whatever failed.

Under `/v1/` the routes speak OpenAI's and Anthropic's wire formats, so their errors do too: the
official SDKs read the body to raise their own typed exceptions (`openai.NotFoundError`, ...).
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from bulkinfer.jobs.errors import InputError
from bulkinfer.jobs.lora_adapters import UnknownAdapter
from bulkinfer.jobs.model_registry import UnknownModel
from bulkinfer.jobs.planning.retry import NothingToRetry, NotRetryable
from bulkinfer.jobs.public_paths import public_text
from bulkinfer.jobs.scheduling.schedules import ScheduleNotFound
from bulkinfer.jobs.spec import validation_messages
from bulkinfer.jobs.state.merge import MergeError
from bulkinfer.jobs.state.repository import JobConflict, JobNotFound
from bulkinfer.jobs.state.status import IllegalTransition


class HttpError(Exception):
    """An error with the status code and the message the client should see."""

    def __init__(self, status_code: int, message: str, messages: list[str] | None = None,
                 headers: dict[str, str] | None = None, *, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.messages = messages or []
        self.headers = headers or {}
        self.param = param  # OpenAI's error fields: the parameter at fault, a machine-readable code
        self.code = code


def invalid_model(error: ValidationError, what: str = "job spec") -> HttpError:
    """422 `invalid <what>: ...` with one message per field."""
    messages = validation_messages(error)
    return HttpError(422, f"invalid {what}: " + "; ".join(messages), messages)


def error_response(error: HttpError, path: str = "") -> JSONResponse:
    """The error body for a request to `path` (the wire format's under `/v1/`, else ours: `detail`,
    `messages`) with the error's status and headers. No body names a place the service keeps files
    in (an upload's key, the job store's bucket, prefix or directory: jobs/public_paths.py)."""
    message = encodable(public_text(error.message))
    if path.startswith(ANTHROPIC_PREFIX):
        body: dict[str, object] = {"type": "error", "error": {"type": _anthropic_type(error.status_code),
                                                              "message": message}}
    elif path.startswith(OPENAI_PREFIX):
        body = {"error": {"message": message, "type": _openai_type(error.status_code), "param": error.param,
                          "code": error.code}}
    else:
        body = {"detail": message, "messages": [encodable(public_text(line)) for line in error.messages]}
    return JSONResponse(body, status_code=error.status_code, headers=error.headers or None)


OPENAI_PREFIX = "/v1/"
ANTHROPIC_PREFIX = "/v1/messages/"
_OPENAI_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}
_ANTHROPIC_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                    413: "request_too_large", 429: "rate_limit_error"}


def _openai_type(status: int) -> str:
    return _OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def _anthropic_type(status: int) -> str:
    return _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def encodable(text: str) -> str:
    """The text as UTF-8 can carry it: a lone surrogate echoed from a request becomes `\\udXXX`."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


# Domain errors and the status each one means at the API.
_STATUS_FOR = [
    (JobNotFound, 404), (ScheduleNotFound, 404), (JobConflict, 409), (IllegalTransition, 409),
    (NotRetryable, 409), (NothingToRetry, 409), (MergeError, 409), (UnknownModel, 400), (UnknownAdapter, 400),
    (InputError, 400)]


def install_error_handlers(app: FastAPI) -> None:
    async def api_error(request: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, HttpError)
        return error_response(error, request.url.path)

    async def domain_error(request: Request, error: Exception) -> JSONResponse:
        status = next(code for kind, code in _STATUS_FOR if isinstance(error, kind))
        return error_response(HttpError(status, str(error)), request.url.path)

    async def request_invalid(request: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, RequestValidationError)
        messages = []
        for item in error.errors():
            where = ".".join(str(part) for part in item["loc"] if part not in ("body", "query", "path"))
            messages.append(f"{where}: {item['msg']}" if where else item["msg"])
        return error_response(HttpError(422, "invalid request: " + "; ".join(messages), messages),
                              request.url.path)

    app.add_exception_handler(HttpError, api_error)
    app.add_exception_handler(RequestValidationError, request_invalid)
    for kind, _status in _STATUS_FOR:
        app.add_exception_handler(kind, domain_error)

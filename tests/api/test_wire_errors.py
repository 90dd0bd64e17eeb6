"""Errors under /v1 come in the shape each official SDK parses (it raises its typed exception and
shows the message); everywhere else in ours."""

from __future__ import annotations

import json

import pytest

from bulkinfer.api.errors import HttpError, error_response


def body(path: str, error: HttpError) -> dict:
    response = error_response(error, path)
    return json.loads(bytes(response.body))


def test_our_routes_keep_our_shape() -> None:
    assert body("/jobs/x", HttpError(404, "no job x", ["one"])) == {"detail": "no job x", "messages": ["one"]}


@pytest.mark.parametrize(("status", "kind"), [(400, "invalid_request_error"), (401, "authentication_error"),
                                              (403, "permission_error"), (404, "invalid_request_error"),
                                              (429, "rate_limit_error"), (503, "server_error")])
def test_openai_routes_answer_openais_error_object(status: int, kind: str) -> None:
    error = HttpError(status, "went wrong", param="endpoint", code="invalid_value")
    expected = {"message": "went wrong", "type": kind, "param": "endpoint", "code": "invalid_value"}
    assert body("/v1/batches", error) == {"error": expected}


@pytest.mark.parametrize(("status", "kind"), [(400, "invalid_request_error"), (401, "authentication_error"),
                                              (404, "not_found_error"), (413, "request_too_large"),
                                              (429, "rate_limit_error"), (500, "api_error")])
def test_anthropic_routes_answer_anthropics_error_object(status: int, kind: str) -> None:
    assert body("/v1/messages/batches/x", HttpError(status, "went wrong")) == {
        "type": "error", "error": {"type": kind, "message": "went wrong"}}

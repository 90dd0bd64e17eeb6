"""Whatever the body, a bad one is a 4xx with a message: never a 500 (the parsing and URI checks
are shared by every JSON route)."""

from __future__ import annotations

import httpx
import pytest

NESTED = "[" * 100_000 + "]" * 100_000
BAD_URI = '{"model": "tiny", "input_uri": "file://localhost/\\ud8cf\\udf30\\u0000"}'


@pytest.mark.parametrize(("method", "path"), [("POST", "/jobs"), ("POST", "/schedules"),
                                               ("POST", "/jobs/job-x/retry")])
@pytest.mark.parametrize("body", [NESTED, '{"model": ' * 50_000 + "1" + "}" * 50_000])
def test_a_deeply_nested_body_is_a_4xx_with_a_message(local_api, method: str, path: str, body: str) -> None:
    answer = httpx.request(method, f"{local_api.url}{path}", content=body,
                           headers={"Content-Type": "application/json"})
    assert 400 <= answer.status_code < 500, answer.text[:300]
    assert "nested" in answer.json()["detail"]


@pytest.mark.parametrize("uri", ["file://localhost/\\ud8cf\\udf30\\u0000", "/data/rows\\u0000.jsonl",
                                 "s3://bucket/\\udc80rows.jsonl", "/data/\\ud800"])
def test_an_input_uri_with_a_nul_or_a_lone_surrogate_is_a_422_naming_it(local_api, uri: str) -> None:
    body = '{"model": "tiny", "prompt_column": "q", "input_uri": "' + uri + '"}'
    answer = httpx.post(f"{local_api.url}/jobs", content=body, headers={"Content-Type": "application/json"})
    assert answer.status_code == 422, answer.text[:300]
    assert "input_uri" in answer.json()["detail"]
    assert "NUL" in answer.json()["detail"] or "surrogate" in answer.json()["detail"]


def test_the_body_found_by_the_stateful_fuzzer_is_a_4xx(local_api) -> None:
    headers = {"Content-Type": "application/json"}
    answer = httpx.post(f"{local_api.url}/jobs", content=BAD_URI, headers=headers)
    assert 400 <= answer.status_code < 500 and answer.json()["detail"]


def test_an_uploads_spec_field_is_checked_the_same_way(local_api) -> None:
    answer = httpx.post(f"{local_api.url}/jobs", files={"spec": (None, NESTED), "file": ("r.jsonl", b"{}\n")})
    assert answer.status_code == 422 and "'spec' field is nested too deeply" in answer.json()["detail"]

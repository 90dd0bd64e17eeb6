"""The check of an OpenAI batch input file's lines as it uploads: OpenAI's problem codes, the file's
line numbers, whatever chunks the bytes arrive in."""

from __future__ import annotations

import json

import pytest

from bulkinfer.api.v1.batch_lines import BatchLinesScanner, BatchLinesSummary


def request(custom_id: str = "r1", model: str = "tiny", url: str = "/v1/chat/completions",
            **changes: object) -> dict:
    line = {"custom_id": custom_id, "method": "POST", "url": url,
            "body": {"model": model, "messages": [{"role": "user", "content": "hi"}]}}
    line.update(changes)
    return line


def encode(*lines: dict | str | bytes) -> bytes:
    parts = []
    for line in lines:
        if isinstance(line, dict):
            line = json.dumps(line)
        parts.append(line if isinstance(line, bytes) else line.encode())
    return b"\n".join(parts) + b"\n"


def scan(data: bytes, chunk: int = 7, **options: int) -> BatchLinesSummary:
    scanner = BatchLinesScanner(**options)
    for start in range(0, len(data), chunk):
        scanner.feed(data[start:start + chunk])
    return scanner.finish()


def problems(summary: BatchLinesSummary) -> list[tuple[str, int | None, str | None]]:
    return [(problem.code, problem.line, problem.param) for problem in summary.problems]


@pytest.mark.parametrize("chunk", [1, 5, 64, 1 << 20])
def test_a_good_file_has_no_problems_and_names_its_urls_and_models_by_first_line(chunk) -> None:
    data = encode(request("a"), request("b", model="small"), request("c", url="/v1/completions"),
                  request("d"))
    summary = scan(data, chunk)
    assert summary.problems == [] and summary.problem_count == 0
    assert summary.requests == 4
    assert summary.urls == {"/v1/chat/completions": 1, "/v1/completions": 3}
    assert summary.models == {"tiny": 1, "small": 2}


def test_each_problem_has_openais_code_and_the_line_of_the_file() -> None:
    data = encode(
        request("ok"),                                                  # 1
        "{not json",                                                    # 2
        "[1, 2]",                                                       # 3
        {k: v for k, v in request("x").items() if k != "custom_id"},    # 4
        {k: v for k, v in request("y").items() if k != "body"},         # 5
        request("z", body={"messages": []}),                            # 6
        request("w", method="GET"),                                     # 7
        request(custom_id=7),                                           # 8
        request("v", body="text"),                                      # 9
        request("u", url=None),                                         # 10
        request("t", body={"model": 3}),                                # 11
        request("ok"),                                                  # 12
    )
    summary = scan(data)
    assert problems(summary) == [
        ("invalid_json_line", 2, None), ("invalid_json_line", 3, None),
        ("missing_required_parameter", 4, "custom_id"), ("missing_required_parameter", 5, "body"),
        ("missing_required_parameter", 6, "body.model"), ("invalid_request", 7, "method"),
        ("invalid_request", 8, "custom_id"), ("invalid_request", 9, "body"), ("invalid_request", 10, "url"),
        ("invalid_request", 11, "body.model"), ("duplicate_custom_id", 12, "custom_id")]
    assert summary.problem_count == 11 and summary.requests == 12
    messages = [problem.message for problem in summary.problems]
    assert "Missing required parameter: 'custom_id'" in messages[2]
    assert "'GET'" in messages[5] and "POST" in messages[5]
    assert "line 1" in messages[10] and "'ok'" in messages[10]


def test_blank_lines_are_lines_but_not_requests_and_the_last_line_needs_no_newline() -> None:
    data = b"\n" + encode(request("a")) + b"   \r\n\n" + json.dumps(request("a")).encode()  # no final \n
    summary = scan(data, chunk=3)
    assert summary.requests == 2
    assert problems(summary) == [("duplicate_custom_id", 5, "custom_id")]
    crlf = scan(encode(request("a")).replace(b"\n", b"\r\n") + b"\xef\xbb\xbf")  # a stray BOM, mid-file
    assert crlf.requests == 2 and problems(crlf) == [("invalid_json_line", 2, None)]
    bom = scan(b"\xef\xbb\xbf" + encode(request("a")))  # a BOM at the very start is no problem
    assert bom.problems == [] and bom.requests == 1


def test_an_empty_or_blank_file_has_no_requests() -> None:
    for data in (b"", b"\n\n  \n", b"\r\n"):
        summary = scan(data)
        assert summary.requests == 0
        assert problems(summary) == [("empty_file", None, None)] and summary.problem_count == 1


def test_a_line_past_a_mib_is_read_across_chunks_and_one_past_the_limit_is_a_problem_not_memory() -> None:
    long_prompt = "x" * (3 << 20)
    big = request("big", body={"model": "tiny", "messages": [{"role": "user", "content": long_prompt}]})
    data = encode(request("a"), big, request("b"))
    summary = scan(data, chunk=1 << 20)
    assert summary.problems == [] and summary.requests == 3 and summary.models == {"tiny": 1}
    scanner = BatchLinesScanner(max_line_bytes=1 << 20)
    for start in range(0, len(data), 4096):
        scanner.feed(data[start:start + 4096])
        assert len(scanner._buffer) <= 1 << 20  # never more than the limit of one line held
    limited = scanner.finish()
    assert problems(limited) == [("invalid_request", 2, None)] and limited.requests == 3
    assert f"{len(json.dumps(big)):,} bytes" in limited.problems[0].message
    tail = scan(encode(request("a")) + b"y" * 5000, chunk=1000, max_line_bytes=4096)  # no final newline
    assert problems(tail) == [("invalid_request", 2, None)] and "5,000 bytes" in tail.problems[0].message


def test_bytes_that_are_not_utf8_are_an_invalid_json_line() -> None:
    data = encode(request("a"), b'{"custom_id": "\xff\xfe", "method": "POST"}', request("b"))
    summary = scan(data)
    assert problems(summary) == [("invalid_json_line", 2, None)]
    assert "UTF-8" in summary.problems[0].message


def test_only_the_first_hundred_problems_are_kept_with_the_true_count() -> None:
    data = encode(request("a"), *["nope"] * 250, request("b"))
    summary = scan(data, chunk=4096)
    assert summary.problem_count == 250 and len(summary.problems) == 100
    assert [problem.line for problem in summary.problems] == list(range(2, 102))
    assert summary.requests == 252


def test_what_is_kept_of_urls_and_models_is_bounded_whatever_the_file() -> None:
    """48 lines with 1 MiB urls once made a 50 MB record that every batch listing returned."""
    huge = "/v1/" + "x" * (1 << 20)
    summary = scan(encode(*(request(f"r{i}", url=huge + str(i)) for i in range(48))), chunk=1 << 16)
    assert summary.urls == {} and summary.problem_count == 48
    assert problems(summary)[0] == ("invalid_request", 1, "url")
    assert "1,048,581 characters, over the 256" in summary.problems[0].message
    assert len(summary.model_dump_json()) < 20_000

    many = scan(encode(*(request(f"r{i}", url=f"/v1/u{i}", model=f"m{i % 300}") for i in range(300))),
                chunk=1 << 16)
    assert len(many.urls) == 16 and len(many.models) == 16
    assert problems(many)[0] == ("invalid_request", 17, "url")
    assert "more than 16 different urls" in many.problems[0].message
    models = scan(encode(*(request(f"r{i}", model=f"adapter-{i}") for i in range(300))), chunk=1 << 16)
    assert len(models.models) == 256 and models.problem_count == 44
    assert "more than 256 different models" in models.problems[0].message

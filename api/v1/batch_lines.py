"""The lines of an OpenAI batch input file, checked as it uploads, the way OpenAI checks them.

Each line must be a JSON object with `custom_id` (a string, unique in the file), `method` ("POST"),
`url` (a string), and `body` (an object with a string `model`). Problems carry OpenAI's codes and the
1-based line of the file (blank lines count as lines but are not requests), so a batch created from
the file can fail with `errors.data[{code, line, message, param}]` as OpenAI's does. What the body
asks for beyond that (sampling values, messages) is each request's own error at run time.

The scanner is fed the upload chunk by chunk and holds one line at a time (a line past
`max_line_bytes` is read past, not held), plus a 16-byte digest per custom_id.
"""

from __future__ import annotations

import hashlib
from typing import Any

from pydantic import BaseModel

from bulkinfer.jobs.formats.json_text import UnreadableJson, loads_untrusted
from bulkinfer.jobs.formats.lines import MAX_LINE_BYTES, UTF8_BOM

MAX_PROBLEMS = 100  # kept in the summary; problem_count has them all
# What the summary keeps of the lines' urls and models is bounded, whatever the file: a url or model
# name past MAX_NAME_CHARS is its line's problem (no endpoint or model is that long), and so is a
# url or model past the first MAX_URLS / MAX_MODELS different ones (a batch runs one endpoint, and
# one model with its LoRA adapters).
MAX_NAME_CHARS = 256
MAX_URLS = 16
MAX_MODELS = 256

INVALID_JSON_LINE = "invalid_json_line"
MISSING_REQUIRED_PARAMETER = "missing_required_parameter"
INVALID_REQUEST = "invalid_request"
DUPLICATE_CUSTOM_ID = "duplicate_custom_id"
EMPTY_FILE = "empty_file"


class LineProblem(BaseModel):
    code: str
    line: int | None  # None only for a problem of the whole file (empty_file)
    message: str
    param: str | None = None


class BatchLinesSummary(BaseModel):
    requests: int  # non-blank lines
    urls: dict[str, int]  # each distinct url of a line without problems → the first line using it
    models: dict[str, int]  # each distinct body.model of such a line → the first line using it
    problems: list[LineProblem]  # the first MAX_PROBLEMS, in line order
    problem_count: int


class _Problem(Exception):
    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param


def _missing(param: str) -> _Problem:
    return _Problem(MISSING_REQUIRED_PARAMETER, f"Missing required parameter: '{param}'.", param)


class BatchLinesScanner:
    """Feed it the file's bytes in any chunks, then `finish()` for the summary."""

    def __init__(self, max_line_bytes: int = MAX_LINE_BYTES, max_problems: int = MAX_PROBLEMS) -> None:
        self.max_line_bytes = max_line_bytes
        self.max_problems = max_problems
        self._buffer = bytearray()  # the current line's bytes so far (empty while skipping)
        self._skipped = 0  # bytes of the current line read past (it is over max_line_bytes)
        self._line = 0  # lines completed
        self._requests = 0
        self._urls: dict[str, int] = {}
        self._models: dict[str, int] = {}
        self._problems: list[LineProblem] = []
        self._problem_count = 0
        self._first_line_of: dict[bytes, int] = {}  # custom_id digest → its first line

    def feed(self, data: bytes) -> None:
        start = 0
        while start < len(data):
            newline = data.find(b"\n", start)
            end = len(data) if newline < 0 else newline
            self._take(data[start:end])
            if newline < 0:
                return
            self._end_line()
            start = newline + 1

    def finish(self) -> BatchLinesSummary:
        if self._buffer or self._skipped:  # the last line has no trailing newline
            self._end_line()
        if self._requests == 0:
            self._add(None, _Problem(EMPTY_FILE, "The batch input file is empty. Please ensure that the "
                                                 "batch contains at least one request."))
        return BatchLinesSummary(requests=self._requests, urls=self._urls, models=self._models,
                                 problems=self._problems, problem_count=self._problem_count)

    def _take(self, piece: bytes) -> None:
        if self._skipped:
            self._skipped += len(piece)
        elif len(self._buffer) + len(piece) > self.max_line_bytes:
            self._skipped = len(self._buffer) + len(piece)
            self._buffer.clear()
        else:
            self._buffer += piece

    def _end_line(self) -> None:
        self._line += 1
        data, skipped = bytes(self._buffer), self._skipped
        self._buffer.clear()
        self._skipped = 0
        if self._line == 1 and data.startswith(UTF8_BOM):
            data = data[len(UTF8_BOM):]
        data = data.removesuffix(b"\r")
        if not skipped and not data.strip():
            return  # a blank line: no request
        self._requests += 1
        try:
            if skipped:
                raise _Problem(INVALID_REQUEST, f"This line is {skipped:,} bytes, over the "
                                                f"{self.max_line_bytes:,} bytes a request line may have.")
            self._check(data)
        except _Problem as problem:
            self._add(self._line, problem)

    def _check(self, data: bytes) -> None:
        try:
            record = loads_untrusted(data)
        except UnreadableJson as error:
            raise _Problem(INVALID_JSON_LINE,
                           f"This line is not parseable as valid JSON ({error}).") from None
        if not isinstance(record, dict):
            raise _Problem(INVALID_JSON_LINE, f"This line is a JSON {_json_type(record)}, not a JSON object.")
        custom_id = record.get("custom_id")
        first = self._register(custom_id) if isinstance(custom_id, str) and custom_id else None
        url, body = _required_fields(record)
        if first is not None:
            raise _Problem(DUPLICATE_CUSTOM_ID, f"The custom_id {custom_id!r} is a duplicate of the one on "
                                                f"line {first}; the custom_id of each request in a batch "
                                                "must be unique.", "custom_id")
        _check_kept(url, "url", self._urls, MAX_URLS, "different urls (a batch has one endpoint)")
        _check_kept(body["model"], "body.model", self._models, MAX_MODELS,
                    "different models (a batch runs one model and its LoRA adapters)")
        self._urls.setdefault(url, self._line)
        self._models.setdefault(body["model"], self._line)

    def _register(self, custom_id: str) -> int | None:
        """The first line of an earlier request with this custom_id, else None (and remember it)."""
        digest = hashlib.blake2b(custom_id.encode("utf-8", "surrogatepass"), digest_size=16).digest()
        first = self._first_line_of.get(digest)
        if first is None:
            self._first_line_of[digest] = self._line
        return first

    def _add(self, line: int | None, problem: _Problem) -> None:
        self._problem_count += 1
        if len(self._problems) < self.max_problems:
            self._problems.append(LineProblem(code=problem.code, line=line, message=problem.message,
                                              param=problem.param))


def _required_fields(record: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The line's url and body; _Problem for the first field missing or of the wrong kind."""
    for name in ("custom_id", "method", "url", "body"):
        if name not in record:
            raise _missing(name)
    custom_id, method, url, body = record["custom_id"], record["method"], record["url"], record["body"]
    if not isinstance(custom_id, str) or not custom_id:
        raise _Problem(INVALID_REQUEST, f"custom_id must be a non-empty string, not {_shown(custom_id)}.",
                       "custom_id")
    if method != "POST":
        raise _Problem(INVALID_REQUEST, f"method must be 'POST', not {_shown(method)}.", "method")
    if not isinstance(url, str) or not url:
        raise _Problem(INVALID_REQUEST, f"url must be a non-empty string, not {_shown(url)}.", "url")
    if not isinstance(body, dict):
        raise _Problem(INVALID_REQUEST, f"body must be a JSON object, not a JSON {_json_type(body)}.", "body")
    if "model" not in body:
        raise _missing("body.model")
    if not isinstance(body["model"], str) or not body["model"]:
        raise _Problem(INVALID_REQUEST,
                       f"body.model must be a non-empty string, not {_shown(body['model'])}.", "body.model")
    return url, body


def _check_kept(value: str, param: str, kept: dict[str, int], most: int, what: str) -> None:
    """_Problem when `value` is too long to keep, or a new one past the `most` kept."""
    if len(value) > MAX_NAME_CHARS:
        raise _Problem(INVALID_REQUEST, f"{param} is {len(value):,} characters, over the {MAX_NAME_CHARS} a "
                                        f"{param} may have.", param)
    if value not in kept and len(kept) >= most:
        raise _Problem(INVALID_REQUEST, f"{param} {_shown(value)}: this file uses more than {most} {what}.",
                       param)


def _json_type(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), "number")


def _shown(value: Any) -> str:
    if isinstance(value, str):
        return repr(value[:40] + ("…" if len(value) > 40 else ""))
    return f"a JSON {_json_type(value)}"

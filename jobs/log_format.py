"""Structured logs (`log_format = "json"`): one JSON object a line, for log collectors.

Each line carries time, level, logger and message, and the job id, shard, worker and tenant of the
work the line is about where that is known: the worker sets them around a task (`log_context`),
the fields travel in a context variable, so every line logged under it carries them, from any
module. Secrets never reach a line: every configured secret value (API keys, the webhook secret,
AWS credentials) and the password part of any URL are replaced by `***`.
Plain text stays the default, for a terminal.
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

CONTEXT_FIELDS = ("job_id", "shard", "worker", "tenant")
_context: contextvars.ContextVar[tuple[tuple[str, Any], ...]] = contextvars.ContextVar(
    "bulkinfer_log_context", default=())
# user:password@ in a URL (redis://:secret@host, s3 endpoints with credentials)
_URL_PASSWORD = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)(?P<user>[^:/@\s]*):(?P<password>[^@/\s]+)@",
                           re.I)
SECRET_ENVIRONMENT = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "BULKINFER_API_KEYS",
                      "BULKINFER_ADMIN_API_KEYS", "BULKINFER_WEBHOOK_SECRET")


def _with(fields: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """The current context with the given fields (None values left out) over it."""
    return tuple({**dict(_context.get()), **{k: v for k, v in fields.items() if v is not None}}.items())


@contextmanager
def log_context(**fields: Any) -> Iterator[None]:
    """Every line logged inside (in this thread or task) carries these fields."""
    token = _context.set(_with(fields))
    try:
        yield
    finally:
        _context.reset(token)


def add_to_log_context(**fields: Any) -> None:
    """Add fields for the rest of the enclosing `log_context` (e.g. a tenant learnt mid-task)."""
    _context.set(_with(fields))


def secret_values(settings_secrets: Iterable[str | None] = (),
                  environ: dict[str, str] | None = None) -> list[str]:
    """The strings no log line may contain: the given secrets (e.g. `api_keys`, split into keys) and
    the secret environment variables."""
    environ = dict(os.environ) if environ is None else environ
    values: set[str] = set()
    for raw in [*settings_secrets, *(environ.get(name) for name in SECRET_ENVIRONMENT)]:
        for part in re.split(r"[,\s]+", raw or ""):
            key = part.split("=", 1)[-1]  # "tenant=key" lists
            if len(key) >= 6:  # shorter strings would blank ordinary words
                values.add(key)
    return sorted(values, key=len, reverse=True)


def redact(text: str, secrets: Iterable[str]) -> str:
    text = _URL_PASSWORD.sub(lambda m: f"{m['scheme']}{m['user']}:***@", text)
    for secret in secrets:
        text = text.replace(secret, "***")
    return text


class JsonFormatter(logging.Formatter):
    def __init__(self, secrets: Iterable[str] = ()) -> None:
        super().__init__()
        self.secrets = list(secrets)

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update(dict(_context.get()))
        for name in CONTEXT_FIELDS:  # `logger.info(..., extra={"job_id": ...})` works too
            if hasattr(record, name):
                entry[name] = getattr(record, name)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return redact(json.dumps(entry, default=str), self.secrets)


def configure_json_logging(level: int | str = logging.INFO, secrets: Iterable[str] = ()) -> None:
    """The root logger writes JSON lines to stderr (its other handlers removed)."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter(secrets))
    root = logging.getLogger()
    for existing in list(root.handlers):
        root.removeHandler(existing)
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)

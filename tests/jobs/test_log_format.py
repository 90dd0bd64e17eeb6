"""JSON logs: one object a line with the job, shard, worker and tenant of the work it is about, and
never a secret (configured keys, AWS credentials, URL passwords)."""

from __future__ import annotations

import io
import json
import logging
import threading

from bulkinfer.jobs.log_format import JsonFormatter, add_to_log_context, log_context, secret_values


def capture(secrets: list[str]) -> tuple[logging.Logger, io.StringIO]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter(secrets))
    logger = logging.getLogger(f"test-json-{id(stream)}")
    logger.handlers, logger.propagate = [handler], False
    logger.setLevel(logging.INFO)
    return logger, stream


def lines(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_each_line_is_json_with_the_context_of_its_work() -> None:
    logger, stream = capture([])
    with log_context(job_id="job-1", shard="3", worker="w@a"):
        add_to_log_context(tenant="acme")  # learnt once the task read its job
        logger.info("shard %d done", 3)
    logger.warning("outside")
    first, second = lines(stream)
    fields = ("level", "logger", "message", "job_id", "shard", "worker", "tenant")
    assert {key: first[key] for key in fields} == {
        "level": "info", "logger": logger.name, "message": "shard 3 done", "job_id": "job-1", "shard": "3",
        "worker": "w@a", "tenant": "acme"}
    assert "time" in first and "job_id" not in second


def test_the_context_is_per_thread() -> None:
    logger, stream = capture([])
    with log_context(job_id="job-main"):
        thread = threading.Thread(target=lambda: logger.info("other thread"))
        thread.start()
        thread.join()
    assert "job_id" not in lines(stream)[0]


def test_no_line_carries_a_secret() -> None:
    environ = {"AWS_SECRET_ACCESS_KEY": "aws-very-secret-key", "BULKINFER_API_KEYS": "acme=acme-secret-1"}
    logger, stream = capture(secret_values(["root-admin-key", None], environ))
    logger.info("broker redis://:hunter22@redis:6379/0 with aws-very-secret-key, key acme-secret-1 "
                "and root-admin-key")
    try:
        raise ValueError("failed with aws-very-secret-key")
    except ValueError:
        logger.exception("boom")
    text = stream.getvalue()
    for secret in ("hunter22", "aws-very-secret-key", "acme-secret-1", "root-admin-key"):
        assert secret not in text
    assert "redis://:***@redis:6379/0" in lines(stream)[0]["message"]

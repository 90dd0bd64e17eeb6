"""The API fuzzed with schemathesis from its own OpenAPI schema, in process: no 5xx, every answer
as the schema says (status codes, content types, bodies, `Allow` headers), and no schema-valid job
spec refused with 422 (the schema states the rules the API enforces). Derandomized: the same cases
on every run."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.generation.stateful import run_state_machine_as_test
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from bulkinfer.api.app import create_app
from bulkinfer.jobs.settings import Settings
from bulkinfer.jobs.spec import JobSpec
from tests.api.conftest import MODELS

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
EXAMPLES_PER_OPERATION = 30


SEEDED_ROWS = b"".join(json.dumps({"id": n, "q": f"question {n}"}).encode() + b"\n" for n in range(4))
# What a generated POST /jobs (or /schedules) body must not keep to create a job here (most bodies are
# steered so): fields this deployment refuses for reasons a schema cannot state (a column the seeded
# rows lack, a folder or webhook elsewhere, a priority above the open API's cap...).
REFUSED_HERE = ("messages_column", "template", "id_column", "sampling_column", "response_format_column",
                "passthrough_columns", "input_format", "output_uri", "webhook_url", "priority",
                "completion_window", "dry_run", "tenant", "parent_job_id", "retry_error_codes")


CREATES = {"POST /jobs": "job_id", "POST /jobs/{job_id}/retry": "job_id", "POST /schedules": "id"}


def seed_input(store: Path) -> Path:
    """Rows a steered submit names (in the local store, where a submit may read)."""
    seeded = store / "inputs" / "rows.jsonl"
    seeded.parent.mkdir(parents=True)
    seeded.write_bytes(SEEDED_ROWS)
    return seeded


def steered_bodies(operation: str, body: object, seeded: Path):  # noqa: ANN201 - a hypothesis strategy
    """Most generated submits and schedules turned into ones that create a real job (or schedule) over
    the seeded rows, keeping every other generated field; the rest left as generated."""
    if not isinstance(body, dict):
        return st.just(body)
    if operation == "POST /jobs" and ("spec" in body or "file" in body):  # a multipart upload
        real = {"spec": json.dumps({"model": "tiny", "prompt_column": "q"}), "file": SEEDED_ROWS}
    elif operation == "POST /jobs":
        real = {key: value for key, value in body.items() if key not in REFUSED_HERE}
        real.update(model="tiny", input_uri=str(seeded), prompt_column="q")
    elif operation == "POST /schedules":
        template = body.get("job") if isinstance(body.get("job"), dict) else {}
        real = {**{key: value for key, value in body.items() if key in ("name", "paused")},
                "cron": "0 * * * *", "input_prefix": f"{seeded.parent}/",
                "job": {**{key: value for key, value in template.items()
                           if key in JobSpec.model_fields and key not in REFUSED_HERE and key != "input_uri"},
                        "model": "tiny", "prompt_column": "q"}}
    else:
        return st.just(body)
    return st.sampled_from([real, real, real, body])


def steered_schema(redis_url: str, tmp_path: Path):  # noqa: ANN201
    """The API's schema over an app with a seeded input, its generated bodies steered to it."""
    settings_ = Settings(broker_url=redis_url, store_uri=str(tmp_path / "store"), models=json.dumps(MODELS))
    seeded = seed_input(tmp_path / "store")
    schema = schemathesis.openapi.from_asgi("/openapi.json", create_app(settings_))

    @schema.hook
    def flatmap_body(context, body):  # noqa: ANN001, ANN202 - schemathesis's hook signature
        return steered_bodies(context.operation.label, body, seeded)

    return settings_, schema, seeded


def test_generated_requests_get_no_server_error_and_answers_the_schema_describes(redis_url, tmp_path) -> None:
    _, schema, _ = steered_schema(redis_url, tmp_path)
    failures: list[tuple[str, str]] = []
    refused: Counter[tuple[str, str]] = Counter()
    calls: Counter[str] = Counter()
    answers: Counter[tuple[str, int]] = Counter()

    def checker(label: str):  # noqa: ANN202 - one test body per operation (hypothesis wants no defaults)
        def run(case) -> None:  # noqa: ANN001
            calls[label] += 1
            response = case.call()
            answers[(label, response.status_code)] += 1
            if response.status_code == 422:
                refused[(label, response.json()["detail"])] += 1
            try:
                case.validate_response(response, checks=CHECKS)
            except Exception as error:  # noqa: BLE001 - collected, reported together below
                failures.append((label, str(error)[:500]))
        return run

    for result in schema.get_all_operations():
        operation = result.ok()
        fuzz = settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, derandomize=True, database=None,
                        suppress_health_check=list(HealthCheck))(
            given(operation.as_strategy())(checker(operation.label)))
        fuzz()
    cases = sum(calls.values())
    print(f"per operation: {cases} cases, answers {dict(answers)}")
    assert cases > 200
    assert failures == []
    assert answers[("POST /jobs", 201)] >= EXAMPLES_PER_OPERATION // 3  # steered submits create jobs
    # Schema-valid bodies refused with 422 only for what a schema cannot state: a cron whose fields are
    # shaped right but out of range (the schema states the shape, check_cron the ranges) or that no date
    # matches (February 31st); a spec whose
    # row mapping does not fit its input's format (detected from the file's content); the multipart
    # `spec` field's text that is not JSON; two row mappings given at once (each may be null, and JSON
    # Schema's `required` counts a null as given, so the schema cannot say "at most one is set").
    # A csv_encoding for an input that is not CSV or TSV (its format detected from the file's name).
    # And a completion_window longer than the deployment's max_completion_window (a setting, not schema),
    # and a usage range whose `until` is not after its `since` or spans too long (two fields together).
    explained = ("is not a valid cron expression", "never fires: no date matches it",
                 "input needs exactly one of prompt_column",
                 "max_completion_window", "must be after since", "a usage range may span at most",
                 "field is not JSON", "give exactly one of prompt_column, messages_column or template",
                 "csv_encoding: only CSV or TSV input has a text encoding")
    unexplained = [(label, detail) for label, detail in refused
                   if not any(reason in detail for reason in explained)]
    assert unexplained == [], "\n".join(map(str, unexplained))


def test_options_and_405_answers_name_every_method_the_path_takes(redis_url, tmp_path) -> None:
    from fastapi.testclient import TestClient

    settings_ = Settings(broker_url=redis_url, store_uri=str(tmp_path / "store"), models=json.dumps(MODELS))
    with TestClient(create_app(settings_)) as client:
        for path, allow in [("/jobs", "GET, OPTIONS, POST"),
                            ("/schedules", "GET, OPTIONS, POST"),
                            ("/jobs/job-x", "GET, OPTIONS"),
                            ("/schedules/s-1", "DELETE, GET, OPTIONS")]:
            options = client.options(path)
            assert (options.status_code, options.headers["allow"]) == (204, allow), path
            refused = client.put(path)
            assert (refused.status_code, refused.headers["allow"]) == (405, allow), path
            assert refused.json()["detail"] == f"PUT is not allowed on {path} (allowed: {allow})"
        assert client.options("/no-such-route").status_code == 404


STATEFUL_SCENARIOS = 100
STATEFUL_STEPS = 8
def test_stateful_sequences_of_calls_get_no_server_error(redis_url, tmp_path) -> None:
    """Schemathesis's stateful phase: sequences of calls that feed one answer's ids into the next
    call (a job created, then read, cancelled, retried, its results and progress...), from the links
    it infers from the schema. Most generated submits name a served model and a seeded input, so the
    linked calls reach real jobs (counted: the test fails if few do)."""
    settings_, schema, seeded = steered_schema(redis_url, tmp_path)
    # Our own routes' sequences: the /v1 wire formats (single calls fuzzed above) are walked in
    # sequence by their official SDKs (tests/api/test_openai_batches.py, test_anthropic_batches.py),
    # and left in here they thin out the steps that reach real jobs.
    schema = schema.exclude(path_regex="^/v1/")
    store, redis_client = tmp_path / "store", settings_.redis_client()

    failures: list[tuple[str, str]] = []
    calls: Counter[tuple[str, int]] = Counter()
    created: set[str] = set()
    with_real_job: Counter[str] = Counter()

    class Sequences(schema.as_state_machine()):  # type: ignore[misc]
        def teardown(self) -> None:
            """Each scenario starts from the same empty deployment (its links depend on the answers:
            hypothesis needs the same calls to answer the same way when it replays a scenario)."""
            redis_client.flushdb()
            for entry in store.iterdir():
                if entry != seeded.parent:
                    shutil.rmtree(entry)

        def validate_response(self, response, case, additional_checks=None, **kwargs) -> None:  # noqa: ANN001, ANN003, ARG002
            calls[(case.operation.label, response.status_code)] += 1
            parameters = case.path_parameters or {}
            if parameters.get("job_id") in created or parameters.get("schedule_id") in created:
                with_real_job[case.operation.label] += 1
            if response.status_code == 201 and case.operation.label in CREATES:
                created.add(response.json()[CREATES[case.operation.label]])
            try:
                case.validate_response(response, checks=CHECKS)
            except Exception as error:  # noqa: BLE001 - collected, reported together below
                failures.append((case.operation.label, str(error)[:500]))

    run_state_machine_as_test(Sequences, settings=settings(
        max_examples=STATEFUL_SCENARIOS, stateful_step_count=STATEFUL_STEPS, deadline=None, derandomize=True,
        database=None, suppress_health_check=list(HealthCheck)))
    print(f"stateful: {sum(calls.values())} calls, {len(created)} jobs and schedules created, "
          f"{sum(with_real_job.values())} calls on one of them: {dict(with_real_job)}")
    assert sum(calls.values()) > 2 * STATEFUL_SCENARIOS  # sequences, not single calls
    assert failures == []
    # The linked calls reached real jobs and schedules, not only 404s for ids that never existed.
    assert sum(with_real_job.values()) >= STATEFUL_SCENARIOS // 2, dict(with_real_job)
    reached = {label.split(" ", 1)[1].split("}", 1)[-1] for label in with_real_job}
    # (`/retry` too when a scenario cancels before it retries; which do depends on the run's
    # earlier answers, so it is not required: in the full suite one run reached no retry. Results
    # count through either of their routes: which one a run draws follows the same answers.)
    assert {"", "/cancel", "/spec"} <= reached, reached
    assert reached & {"/results", "/results/merged"}, reached

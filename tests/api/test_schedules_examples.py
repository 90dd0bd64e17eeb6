"""infra/examples: the Airflow DAG's tasks submit and wait through the SDK against the live API (no
Airflow installed: the module must still import), and the crontab lines are valid cron running real
CLI commands with real flags.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import shlex
from types import ModuleType

import pytest

from bulkinfer.api.cli import COMMANDS, main
from bulkinfer.api.client import ApiError
from bulkinfer.jobs.scheduling.schedules import check_cron
from bulkinfer.jobs.state.status import JobState
from tests.api import helpers
from tests.api.conftest import RunningApi
from tests.fixtures.services import REPO_ROOT

EXAMPLES = REPO_ROOT / "infra" / "examples"


def load_dag(monkeypatch: pytest.MonkeyPatch, api: RunningApi) -> ModuleType:
    api.put_input("incoming/2026-01-02.jsonl", b'{"prompt": "hello"}\n{"prompt": "world"}\n')
    # file:// URIs name files the server reads, as s3:// ones do (a bare path would be uploaded).
    monkeypatch.setenv("BULKINFER_DAILY_INPUT", "file://" + api.input_uri("incoming/{ds}.jsonl"))
    monkeypatch.setenv("BULKINFER_DAILY_OUTPUT", "file://" + api.input_uri("outputs/{ds}") + "/")
    monkeypatch.setenv("BULKINFER_DAILY_MODEL", "tiny")
    spec = importlib.util.spec_from_file_location("airflow_dag_example", EXAMPLES / "airflow_dag.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_airflow_dag_is_valid_python_that_imports_without_airflow() -> None:
    ast.parse((EXAMPLES / "airflow_dag.py").read_text())
    assert importlib.util.find_spec("airflow") is None  # what this test relies on


def test_the_airflow_tasks_submit_once_per_day_and_wait_through_the_sdk(
        local_api: RunningApi, monkeypatch: pytest.MonkeyPatch) -> None:
    dag = load_dag(monkeypatch, local_api)
    assert dag.dag is None
    job_id = dag.submit_job("2026-01-02", api_url=local_api.url)
    assert dag.submit_job("2026-01-02", api_url=local_api.url) == job_id  # an Airflow retry: same job
    helpers.finish(local_api.repository, job_id)  # what a worker would do

    status = dag.wait_for_job(job_id, api_url=local_api.url, timeout=60)
    assert status["state"] == JobState.SUCCEEDED.value and status["rows"]["total"] == 2

    with pytest.raises(ApiError, match="no such object"):  # a day whose file never came
        dag.submit_job("2026-01-03", api_url=local_api.url)


def crontab_commands() -> list[list[str]]:
    commands = []
    for line in (EXAMPLES / "crontab").read_text().splitlines():
        if not line.strip() or line.lstrip().startswith("#") or re.match(r"^[A-Z_]+=", line):
            continue
        fields = line.split(None, 5)
        check_cron(" ".join(fields[:5]))  # ValueError naming the problem
        command = re.sub(r"\$\([^)]*\)", "2026-01-01", fields[5].replace("\\%", "%"))
        commands.append(shlex.split(command.split(">>")[0]))
    return commands


def test_the_crontab_lines_are_valid_cron_running_real_cli_flags(capsys: pytest.CaptureFixture[str]) -> None:
    commands = crontab_commands()
    assert commands
    for argv in commands:
        assert argv[0] == "bulkinfer" and argv[1] in COMMANDS
        assert main([argv[1], "--help"]) == 0
        usage = capsys.readouterr().out
        flags = [arg for arg in argv[2:] if arg.startswith("--")]
        assert [flag for flag in flags if flag not in usage] == []

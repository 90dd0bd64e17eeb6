"""An Airflow DAG that runs one bulkinfer job a day through the SDK: submit the day's file, wait for
the job, fail the task unless it succeeded. Copy it into your DAGs folder; the Airflow workers need
`pip install 'bulkinfer[client]'` (no torch) and $BULKINFER_API_URL (and $BULKINFER_API_KEY).

The submit is idempotent (the key is the logical date), so an Airflow retry or a backfill of the
same day never runs the rows twice: it finds the job submitted before and waits for it.

Without Airflow installed the module still imports (the DAG is then None), so the two task
functions can be called and tested on their own.
"""

from __future__ import annotations

import os
from datetime import datetime, timedelta

INPUT_URI = os.environ.get("BULKINFER_DAILY_INPUT", "s3://my-bucket/incoming/{ds}.jsonl")
OUTPUT_URI = os.environ.get("BULKINFER_DAILY_OUTPUT", "s3://my-bucket/outputs/{ds}/")
MODEL = os.environ.get("BULKINFER_DAILY_MODEL", "small")
WAIT_TIMEOUT_S = 6 * 3600


def submit_job(ds: str, api_url: str | None = None) -> str:
    """Submit the job for logical date `ds` (YYYY-MM-DD); its id (returned again on a retry)."""
    from bulkinfer import Client

    with Client(api_url) as client:
        job = client.jobs.create(input=INPUT_URI.format(ds=ds), model=MODEL, prompt_column="prompt",
                                 output_uri=OUTPUT_URI.format(ds=ds), sampling={"max_tokens": 256},
                                 idempotency_key=f"airflow-daily-{ds}")
        return job.job_id


def wait_for_job(job_id: str, api_url: str | None = None, timeout: float = WAIT_TIMEOUT_S) -> dict:
    """Wait until the job ends; raise unless it succeeded. Its status, for XCom."""
    from bulkinfer import Client, JobState

    with Client(api_url) as client:
        status = client.jobs.wait(job_id, poll_interval=30, timeout=timeout, progress=False)
    if status.state != JobState.SUCCEEDED:
        raise RuntimeError(f"bulkinfer job {job_id} {status.state.value}: {status.error or ''}")
    return status.model_dump(mode="json")


try:
    from airflow import DAG
    from airflow.operators.python import PythonOperator
except ImportError:  # not in an Airflow environment
    DAG = None
    dag = None
else:
    with DAG(dag_id="bulkinfer_daily", start_date=datetime(2026, 1, 1), schedule="15 2 * * *", catchup=False,
             default_args={"retries": 3, "retry_delay": timedelta(minutes=5)}, tags=["bulkinfer"]) as dag:
        submit = PythonOperator(task_id="submit", python_callable=submit_job, op_kwargs={"ds": "{{ ds }}"})
        wait = PythonOperator(task_id="wait", python_callable=wait_for_job,
                              op_kwargs={"job_id": "{{ ti.xcom_pull(task_ids='submit') }}"},
                              execution_timeout=timedelta(seconds=WAIT_TIMEOUT_S + 600))
        submit >> wait

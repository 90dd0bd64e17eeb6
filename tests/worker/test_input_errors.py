"""A job whose input cannot be read fails saying why, naming the input as the user gave it: an
upload by its file's name, never by the key the service stored it under."""

from __future__ import annotations

import json

from bulkinfer.jobs.settings import Settings
from bulkinfer.jobs.spec import JobSpec
from bulkinfer.jobs.state.status import JobState
from bulkinfer.worker.process.context import WorkerContext
from bulkinfer.worker.shards.job_lifecycle import plan_job

BUCKET = "jobs-bucket"


def test_an_upload_without_the_mapped_column_fails_the_job_naming_the_file_not_its_key(redis_url, s3) -> None:
    s3.client().create_bucket(Bucket=BUCKET)
    settings = Settings(broker_url=redis_url, store_uri=f"s3://{BUCKET}/deploy",
                        s3_endpoint_url=s3.endpoint_url, models=json.dumps({"tiny": "/models/tiny"}))
    repository = settings.repository()
    job_id = "job-" + "0" * 32
    key = repository.layout(job_id).input_key("rows.csv")  # where the API puts an upload
    repository.store.put_bytes(key, b"id,prompt\n1,hello\n")
    spec = JobSpec(input_uri=repository.store.uri(key), model="tiny", prompt_column="question")
    repository.create(spec, job_id=job_id)

    outcome = plan_job(WorkerContext(settings), job_id, lambda *_: None)

    status = repository.get(job_id)
    assert (outcome["status"], status.state) == ("failed", JobState.FAILED)
    assert status.error.startswith("cannot read the input rows.csv: column 'question' is not in the header")
    assert not [place for place in ("jobs/", "deploy", BUCKET, job_id) if place in status.error], status.error

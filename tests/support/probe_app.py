"""A Celery app for infrastructure tests: the real worker settings plus one probe task."""

from __future__ import annotations

import os

import boto3

from bulkinfer.worker.process.celery_app import create_app

app = create_app(name="bulkinfer-probe")


@app.task(name="probe.write_object")
def write_object(bucket: str, key: str, body: str) -> dict:
    """Write `body` to s3://bucket/key from inside the worker process and report which process did it."""
    client = boto3.client("s3", endpoint_url=os.environ["BULKINFER_S3_ENDPOINT_URL"])
    client.put_object(Bucket=bucket, Key=key, Body=body.encode())
    return {"pid": os.getpid(), "key": key}

"""Messages name an upload by its file's name and never a place of the job store's own."""

from __future__ import annotations

import pytest

from bulkinfer.jobs.public_paths import public_text

JOB = "job-4bc54c94e55d469581d740d08bf87e85"


@pytest.mark.parametrize("text, shown", [
    (f"cannot read the input s3://bucket/deploy/jobs/{JOB}/input/rows.csv: object not found: "
     f"deploy/jobs/{JOB}/input/rows.csv", "cannot read the input rows.csv: object not found: rows.csv"),
    (f"[Errno 2] No such file or directory: '/tmp/x/store/jobs/{JOB}/input/my_rows.csv'",
     "[Errno 2] No such file or directory: 'my_rows.csv'"),
    (f"input file:///srv/bulkinfer/store/jobs/{JOB}/input/rows.tsv (x)", "input rows.tsv (x)"),
    ("batch input s3://b/p/files/tenant-a/file-0193ab12cd34ef/content: bad line",
     "batch input file-0193ab12cd34ef: bad line"),
    (f"object already exists: deploy/jobs/{JOB}/output/part-00000.csv",
     f"object already exists: jobs/{JOB}/output/part-00000.csv"),
    # What a user gave, or a route, is left as it is.
    ("input_uri s3://mine/rows.csv: no such object", "input_uri s3://mine/rows.csv: no such object"),
    (f"GET /jobs/{JOB}/results: job {JOB} is running", f"GET /jobs/{JOB}/results: job {JOB} is running"),
])
def test_paths_into_the_store_are_written_as_the_user_knows_them(text: str, shown: str) -> None:
    assert public_text(text) == shown

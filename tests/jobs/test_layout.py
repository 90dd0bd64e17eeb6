"""Object-store keys of a job, and a whole job's shards run the way workers will run them."""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bulkinfer.jobs.layout import JobLayout, area_root, output_location
from bulkinfer.jobs.object_store import LocalObjectStore, S3ObjectStore
from bulkinfer.jobs.planning.sharding import plan_shards
from bulkinfer.jobs.spec import JobSpec
from bulkinfer.jobs.state.manifest import build_manifest, write_manifest
from bulkinfer.jobs.state.results import load_shard_results
from tests.jobs.helpers import run_shard


def test_keys_follow_the_documented_layout() -> None:
    layout = JobLayout("j-42", prefix="/bulkinfer/")
    assert layout.spec_key == "bulkinfer/jobs/j-42/job.json"
    assert layout.input_key("rows.parquet") == "bulkinfer/jobs/j-42/input/rows.parquet"
    assert layout.error_part_key(3) == "bulkinfer/jobs/j-42/errors/part-00003.jsonl"
    assert layout.shard_result_key(3) == "bulkinfer/jobs/j-42/shards/part-00003.json"
    assert layout.manifest_key == "bulkinfer/jobs/j-42/manifest.json"
    assert JobLayout("j-42").spec_key == "jobs/j-42/job.json"


def test_each_store_area_is_a_folder_under_the_prefix() -> None:
    assert area_root("files", "/bulkinfer/") == "bulkinfer/files/"
    assert area_root("batches") == "batches/"
    with pytest.raises(ValueError, match="not one of the store's areas"):
        area_root("tenants")  # a tenant's own data, not the service's


@pytest.mark.parametrize("job_id", ["", "../x", "a/b", "-lead", "x" * 129])
def test_job_ids_that_could_escape_their_folder_are_refused(job_id) -> None:
    with pytest.raises(ValueError, match="must be 1-128 letters"):
        JobLayout(job_id)


def test_input_names_are_plain_file_names() -> None:
    with pytest.raises(ValueError, match="plain file name"):
        JobLayout("j").input_key("../job.json")


def test_output_parts_go_to_the_job_folder_or_to_output_uri(s3, s3_store, tmp_path) -> None:
    layout = JobLayout("j1", prefix="p")
    base = {"input_uri": "/in/rows.parquet", "input_format": "parquet", "model": "m", "prompt_column": "q"}
    default = output_location(JobSpec.model_validate(base), s3_store, layout)
    assert default.store is s3_store and default.part_key(7) == "p/jobs/j1/output/part-00007.parquet"

    to_s3 = output_location(JobSpec.model_validate({**base, "output_uri": "s3://results/run-1/",
                                                    "output_format": "jsonl"}), s3_store, layout)
    assert isinstance(to_s3.store, S3ObjectStore) and to_s3.store.bucket == "results"
    assert to_s3.part_key(0) == "run-1/part-00000.jsonl"

    to_dir = output_location(JobSpec.model_validate({**base, "output_uri": (tmp_path / "out").as_uri()}),
                             s3_store, layout)
    assert isinstance(to_dir.store, LocalObjectStore)
    assert to_dir.store.uri(to_dir.part_key(1)) == (tmp_path / "out" / "part-00001.parquet").as_uri()


def test_a_parquet_job_runs_shard_by_shard_into_parquet_parts(store) -> None:
    buffer = io.BytesIO()
    table = pa.table({"id": [f"r{n}" for n in range(95)], "q": [f"q{n}" for n in range(95)],
                      "src": list(range(95))})
    pq.write_table(table, buffer, row_group_size=10)
    store.put_bytes("in/rows.parquet", buffer.getvalue())
    spec = JobSpec(input_uri="/in/rows.parquet", input_format="parquet", output_format="parquet", model="m",
                   prompt_column="q", id_column="id", passthrough_columns=["src"], shard_size=25)
    layout = JobLayout("job-pq")
    plan = plan_shards(store, "in/rows.parquet", spec)
    assert [shard.row_groups for shard in plan] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    for shard in reversed(plan):  # shards finish in any order
        run_shard(store, "in/rows.parquet", store, layout, spec, shard)

    manifest = build_manifest(layout.job_id, spec.spec_hash(), "parquet", len(plan),
                              load_shard_results(store, layout))
    write_manifest(store, layout, manifest)
    parts = [pq.read_table(io.BytesIO(store.get_bytes(part.output.key))) for part in manifest.parts]
    output = pa.concat_tables(parts).to_pydict()
    assert output["id"] == [f"r{n}" for n in range(95)]
    assert output["text"] == [f"q{n}"[::-1] for n in range(95)]
    assert output["src"] == list(range(95))
    assert manifest.rows.total == manifest.rows.succeeded == 95

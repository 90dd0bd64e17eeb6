"""An embed job whose deadline passes with shards not started: the expiry sweep's parts have the
same `fixed_size_list<float32>[dim]` column as the parts of vectors, so pyarrow reads the job's
output folder as one table, the expired rows' vectors null. Redis and moto S3; the shard and the
sweep run in this process, the sweep in a fresh worker context that never loaded the model."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from bulkinfer.jobs.spec import JobSpec
from bulkinfer.worker.models.embedding_size import checkpoint_dimension
from bulkinfer.worker.process.context import WorkerContext
from bulkinfer.worker.shards.deadline_sweep import expire_due
from bulkinfer.worker.shards.job_lifecycle import plan_job
from bulkinfer.worker.shards.shard_runner import committed_result, run_shard
from tests.fixtures.encoder_checkpoints import build_sentence_transformer
from tests.worker.conftest import Pipeline

pytestmark = pytest.mark.timeout(300)

HIDDEN = 32  # build_sentence_transformer's hidden size


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_sentence_transformer(tmp_path_factory.mktemp("bert"), seed=13)


def test_expired_parts_of_an_embed_job_share_the_vector_column_type(
        parts: tuple[Pipeline, dict[str, str]], bert: Path, tmp_path: Path) -> None:
    pipeline, _ = parts
    settings = pipeline.settings.model_copy(update={"models": json.dumps({"bert": str(bert)}),
                                                    "engine_options": json.dumps({"dtype": "float32"})})
    lines = [json.dumps({"id": f"r{n}", "text": f"the cat {n}"}) for n in range(6)]
    spec = JobSpec(input_uri=pipeline.put_input("docs.jsonl", lines), model="bert", task="embed",
                   id_column="id", prompt_column="text", output_format="parquet", shard_size=2,
                   completion_window="1h")
    repository = pipeline.repository
    job_id = repository.create(spec).job_id
    running = WorkerContext(settings)
    plan_job(running, job_id, lambda *_: None)  # no shard task is sent: shard 0 runs below, alone
    try:
        assert run_shard(running, job_id, 0, lambda _job: None)["status"] == "done"
    finally:
        running.hosts.stop()

    sweeper = WorkerContext(settings)  # a reaper elsewhere: it never loaded the model
    expired = expire_due(sweeper, lambda _job: None, notify=lambda _job: None,
                         now=datetime.now(UTC) + timedelta(hours=2))
    assert expired == [(job_id, 1), (job_id, 2)]
    assert sweeper.hosts.hosted() == []

    layout = repository.layout(job_id)
    folder = tmp_path / "output"
    folder.mkdir()
    for index in range(3):
        key = committed_result(repository, layout, index).output.key
        (folder / f"part-{index}.parquet").write_bytes(repository.store.get_bytes(key))
    [column_type] = {pq.read_schema(path).field("embedding").type for path in folder.iterdir()}
    assert pa.types.is_fixed_size_list(column_type) and column_type.list_size == HIDDEN
    assert column_type.value_type == pa.float32()
    table = ds.dataset(folder, format="parquet").to_table().sort_by("id")
    assert table.column("id").to_pylist() == [f"r{n}" for n in range(6)]
    embeddings = table.column("embedding").to_pylist()
    assert all(len(embedding) == HIDDEN for embedding in embeddings[:2])
    assert embeddings[2:] == [None] * 4
    assert table.column("error_code").to_pylist() == [None, None] + ["expired"] * 4
    assert pq.read_table(folder).num_rows == 6  # the folder as one table too


def test_the_checkpoint_dimension_is_the_loaded_embedders(bert: Path, tiny_checkpoint: Path) -> None:
    from bulkinfer.engine.embedder import Embedder

    for folder in (bert, tiny_checkpoint):
        assert checkpoint_dimension(folder) == Embedder.load(folder, dtype="float32").config.dimension
    assert checkpoint_dimension(bert.parent / "nowhere") is None

"""Fenced parts: a run stages its parts under its fencing token; only the committed result's staged
parts reach the part keys, so a run that lost its lease (and resumed late) cannot overwrite them.
Against moto S3 and a local directory."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from bulkinfer.jobs.formats.output import OutputRow
from bulkinfer.jobs.formats.readers import read_shard_rows
from bulkinfer.jobs.formats.rows import RowError
from bulkinfer.jobs.layout import JobLayout, output_location
from bulkinfer.jobs.planning.sharding import plan_shards
from bulkinfer.jobs.spec import JobSpec
from bulkinfer.jobs.state.part_publication import (
    CommitRefused,
    PartMissing,
    publish_parts,
    settle_staged,
    staged_key,
    staging_prefix,
    write_fenced,
)
from tests.jobs.helpers import echo_output

NOW = datetime(2026, 1, 1, tzinfo=UTC)


@pytest.fixture
def job(store):
    lines = [json.dumps({"q": f"question {n}"} if n % 4 else {"other": n}) for n in range(12)]
    store.put_bytes("in/rows.jsonl", ("\n".join(lines) + "\n").encode())
    spec = JobSpec(input_uri="/in/rows.jsonl", input_format="jsonl", output_format="jsonl", model="m",
                   prompt_column="q", shard_size=100)
    layout = JobLayout("job-1", prefix="t")
    [shard] = plan_shards(store, "in/rows.jsonl", spec)
    return store, spec, layout, shard


def outputs(store, spec, shard, suffix: str) -> list[OutputRow]:
    """The shard's rows as a run would answer them; `suffix` tells two runs' answers apart."""
    rows = []
    for item in read_shard_rows(store, "in/rows.jsonl", spec, shard):
        if isinstance(item, RowError):
            rows.append(OutputRow.from_error(item))
        else:
            echo = echo_output(item)
            rows.append(OutputRow.completed(item, echo.text + suffix, "stop", prompt_tokens=1,
                                            cached_tokens=0, completion_tokens=1))
    return rows


def write(job, suffix: str, fence: str):
    store, spec, layout, shard = job
    return write_fenced(store, layout, spec, shard, outputs(store, spec, shard, suffix), fence=fence,
                        created=0, started_at=NOW)


def texts(store, key: str) -> list[str]:
    return [json.loads(line).get("text") or "" for line in store.get_bytes(key).decode().splitlines()]


def test_a_run_that_lost_its_lease_cannot_overwrite_the_committed_parts(job) -> None:
    store, spec, layout, shard = job
    # Run A (generation 1) stalls past its lease; run B (generation 2) runs the shard and commits.
    committed = write(job, " from B", "g2-bbbbbbbb")
    publish_parts(store, committed)
    part = output_location(spec, store, layout).part_key(shard.index)
    assert all(text.endswith(" from B") for text in texts(store, part) if text)
    before = (store.get_bytes(part), store.get_bytes(layout.error_part_key(shard.index)))
    # A resumes and writes: its parts go to its own staging folder, its commit loses, they are dropped.
    standing = write(job, " from A", "g1-aaaaaaaa")
    assert standing == committed and standing.fence == "g2-bbbbbbbb"
    publish_parts(store, standing)  # what A does next (count the shard): publishes B's, again
    assert (store.get_bytes(part), store.get_bytes(layout.error_part_key(shard.index))) == before
    assert not list(store.list(staging_prefix(layout.output_dir)))
    assert not list(store.list(staging_prefix(layout.errors_dir)))


def test_publishing_is_idempotent_and_a_vanished_part_is_an_error(job) -> None:
    store, spec, layout, shard = job
    result = write(job, "", "g1-aaaaaaaa")
    part = result.output.key
    assert not store.exists(part)  # committed, not yet published: a crash here leaves it staged
    assert store.exists(staged_key(part, "g1-aaaaaaaa"))
    publish_parts(store, result)
    published = store.get_bytes(part)
    assert len(published) == result.output.bytes
    publish_parts(store, result)  # a second delivery finds the staged copy gone and the part there
    assert store.get_bytes(part) == published and not store.exists(staged_key(part, "g1-aaaaaaaa"))
    store.delete(part)
    with pytest.raises(PartMissing, match="neither staged nor published"):
        publish_parts(store, result)


def test_settling_before_the_manifest_publishes_committed_parts_and_drops_the_losers(job) -> None:
    store, spec, layout, shard = job
    committed = write(job, " B", "g2-bbbbbbbb")  # committed, then its run died before publishing
    loser = staged_key(committed.output.key, "g1-aaaaaaaa")
    store.put_bytes(loser, b"a late run's part\n")  # a run that never tried to commit
    assert settle_staged(store, layout.output_dir, [committed]) == (1, 1)
    assert settle_staged(store, layout.errors_dir, [committed]) == (1, 0)
    assert store.head(committed.output.key).size == committed.output.bytes
    assert store.head(committed.errors.key).size == committed.errors.bytes
    assert not list(store.list(staging_prefix(layout.output_dir)))
    publish_parts(store, committed)  # and the shard's own late publish still finds everything in place
    assert settle_staged(store, layout.output_dir, [committed]) == (0, 0)


def test_parts_under_an_output_uri_are_staged_and_published_there(job, tmp_path) -> None:
    store, spec, layout, shard = job
    elsewhere = tmp_path / "exports" / "run-1"
    spec = spec.model_copy(update={"output_uri": str(elsewhere)})
    result = write_fenced(store, layout, spec, shard, outputs(store, spec, shard, ""), fence="g1-aaaaaaaa",
                          created=0, started_at=NOW)
    publish_parts(store, result)
    assert (elsewhere / "part-00000.jsonl").stat().st_size == result.output.bytes
    assert not (elsewhere / "_temporary" / "g1-aaaaaaaa" / "part-00000.jsonl").exists()


def test_a_run_whose_job_ended_while_it_staged_its_parts_commits_nothing(job) -> None:
    store, spec, layout, shard = job
    with pytest.raises(CommitRefused):  # the job failed (or was cancelled) while the parts were written
        write_fenced(store, layout, spec, shard, outputs(store, spec, shard, ""), fence="g1-aaaaaaaa",
                     created=0, started_at=NOW, may_commit=lambda: False)
    assert not store.exists(layout.shard_result_key(shard.index))
    assert list(store.list(layout.job_dir + "/")) == []  # its staged parts are gone too

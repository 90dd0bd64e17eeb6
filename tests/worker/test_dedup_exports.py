"""Cross-shard copies take the outcomes of the source run whose result was committed: two runs of
a source shard can race (a stalled run resumes after the reaper re-sent the shard) and compute
different outcomes (seeded sampling agrees on tokens, not always on logprobs or cached tokens), and
a copy must equal the source row that stands, whichever run wrote its exports last."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest

from bulkinfer.jobs.formats.output import OutputRow, PositionLogprobs, TokenLogprob
from bulkinfer.jobs.formats.readers import read_shard_rows
from bulkinfer.jobs.formats.rows import Row
from bulkinfer.jobs.layout import JobLayout
from bulkinfer.jobs.object_store.base import ObjectStore
from bulkinfer.jobs.planning.job_dedup import mark_copies
from bulkinfer.jobs.planning.sharding import ShardPlan, plan_shards
from bulkinfer.jobs.settings import Settings
from bulkinfer.jobs.spec import JobSpec
from bulkinfer.jobs.state.part_publication import publish_parts, write_fenced
from bulkinfer.jobs.state.repository import JobRepository
from bulkinfer.worker.shards.shard_copies import copy_rows, discard_exports, write_exports

NOW = datetime(2026, 1, 1, tzinfo=UTC)
INPUT = "in/rows.jsonl"
STALE, RESENT = "g1-aaaaaaaa", "g2-bbbbbbbb"  # the stalled run's fence, the re-sent run's


@pytest.fixture
def job(redis_url: str, tmp_path: Path) -> tuple[JobRepository, JobSpec, JobLayout, list[ShardPlan]]:
    repository = Settings(broker_url=redis_url, store_uri=str(tmp_path / "store")).repository()
    questions = ["alpha", "beta", "alpha", "gamma"]  # shard 1's "alpha" copies shard 0's
    repository.store.put_bytes(INPUT, "".join(json.dumps({"q": q}) + "\n" for q in questions).encode())
    spec = JobSpec(input_uri=f"/{INPUT}", input_format="jsonl", output_format="jsonl", model="m",
                   prompt_column="q", shard_size=2, sampling={"temperature": 0.7, "seed": 7, "logprobs": 1})
    plan = mark_copies(repository.store, INPUT, spec, plan_shards(repository.store, INPUT, spec))
    assert plan[1].copies == {0: [0, 0]} and plan[0].exports == [0]
    return repository, spec, JobLayout("job-1", prefix=repository.prefix), plan


def rows(store: ObjectStore, spec: JobSpec, shard: ShardPlan) -> list[Row]:
    items = list(read_shard_rows(store, INPUT, spec, shard))
    assert all(isinstance(item, Row) for item in items)
    return items  # type: ignore[return-value]


def answer(row: Row, logprob: float, cached_tokens: int) -> OutputRow:
    """One run's outcome: the same tokens, run-dependent logprobs and cached tokens."""
    token = TokenLogprob(token_id=11, token="ok", logprob=logprob, bytes=list(b"ok"))
    return OutputRow.completed(row, "ok", "stop", prompt_tokens=4, cached_tokens=cached_tokens,
                               completion_tokens=1, logprobs=[PositionLogprobs(token, [token])])


def run_source(job, fence: str, logprob: float, cached_tokens: int) -> str:
    """A run of shard 0 as the worker's sequence has it: exports written, then its result offered
    to the write-once commit; returns the fence of the result that stands."""
    repository, spec, layout, plan = job
    outcomes = {position: answer(row, logprob, cached_tokens)
                for position, row in enumerate(rows(repository.store, spec, plan[0]))}
    write_exports(repository, layout, plan[0], outcomes, fence)
    standing = write_fenced(repository.store, layout, spec, plan[0], list(outcomes.values()), fence=fence,
                            created=0, started_at=NOW)
    publish_parts(repository.store, standing)
    return str(standing.fence)


def output_lines(store: ObjectStore, key: str) -> list[dict]:
    return [json.loads(line) for line in store.get_bytes(key).splitlines()]


def test_a_copy_equals_the_committed_source_row_when_a_stale_run_of_the_source_wrote_its_exports_last(
        job) -> None:
    repository, spec, layout, plan = job
    assert run_source(job, RESENT, logprob=-0.5, cached_tokens=0) == RESENT  # commits
    # The stalled run resumes: it writes its exports after the commit, then loses its own.
    assert run_source(job, STALE, logprob=-0.25, cached_tokens=4) == RESENT
    items = dict(enumerate(rows(repository.store, spec, plan[1])))
    copied, compute = copy_rows(repository, layout, plan[1], {0: items[0]}, should_stop=lambda: False,
                                expires_at=None)
    assert compute == [] and copied[0].deduplicated and copied[0].row_id == items[0].row_id
    outputs = [copied[0], answer(items[1], logprob=-1.0, cached_tokens=0)]
    publish_parts(repository.store, write_fenced(repository.store, layout, spec, plan[1], outputs,
                                                 fence="g1-cccccccc", created=0, started_at=NOW))
    source = output_lines(repository.store, f"{layout.output_dir}/part-00000.jsonl")[0]
    copy = output_lines(repository.store, f"{layout.output_dir}/part-00001.jsonl")[0]
    assert (source["logprobs"][0]["logprob"], source["usage"]["cached_tokens"]) == (-0.5, 0)  # the commit's
    assert copy["id"] == items[0].row_id != source["id"]
    assert {**copy, "id": None} == {**source, "id": None}  # the committed row, under the copy's own id


def test_a_copy_waits_for_the_source_to_commit_not_for_a_run_s_exports(job) -> None:
    repository, spec, layout, plan = job
    item = rows(repository.store, spec, plan[1])[0]
    outcomes = {0: answer(rows(repository.store, spec, plan[0])[0], logprob=-0.25, cached_tokens=4)}
    write_exports(repository, layout, plan[0], outcomes, STALE)  # a run that never commits
    looks: list[int] = []

    def source_commits_on_the_third_look() -> bool:
        looks.append(1)
        if len(looks) == 3:
            run_source(job, RESENT, logprob=-0.5, cached_tokens=0)
        return False

    copied, compute = copy_rows(repository, layout, plan[1], {0: item},
                                should_stop=source_commits_on_the_third_look, expires_at=None)
    assert compute == [] and len(looks) == 3
    assert copied[0].cached_tokens == 0 and copied[0].logprobs[0].chosen.logprob == -0.5  # type: ignore[index]
    discard_exports(repository, layout, plan[0], STALE)  # what the losing run does once it lost
    assert not list(repository.store.list(f"{layout.job_dir}/dedup/part-00000.{STALE}"))


def test_a_copy_keeps_the_stop_string_that_ended_its_source() -> None:
    """The exports a cross-shard copy reads carry each choice's stop_reason (an Anthropic result of
    the copy says `stop_sequence` as its source's does)."""
    from bulkinfer.jobs.formats.output import Choice
    from bulkinfer.jobs.planning.job_dedup import dump_outputs, load_outputs
    from bulkinfer.jobs.sampling import JobSampling

    row = Row(0, "r0", "p", None, JobSampling(), None)
    outputs = {0: OutputRow.with_choices(row, [Choice(0, "a", "stop", stop_reason="END"),
                                               Choice(1, "b", "stop", stop_reason=7)],
                                         prompt_tokens=1, cached_tokens=0, completion_tokens=2)}

    loaded = load_outputs(dump_outputs(outputs))

    assert loaded[0].choices == outputs[0].choices
    assert [choice.stop_reason for choice in loaded[0].choices] == ["END", 7]


def test_a_copy_keeps_its_sources_calls_and_thinking() -> None:
    """Cross-shard copies read calls and thinking back from the exports as the source wrote them."""
    import dataclasses

    from bulkinfer.jobs.formats.output import Choice, ToolCall
    from bulkinfer.jobs.planning.job_dedup import dump_outputs, load_outputs
    from bulkinfer.jobs.sampling import JobSampling

    row = Row(0, "r0", None, [{"role": "user", "content": "Weather?"}], JobSampling(), None)
    call = ToolCall("call_1", "get_weather", {"city": "Oslo", "days": [1, 2]})
    source = OutputRow.with_choices(row, [Choice(0, "", "tool_calls", reasoning="Oslo.", tool_calls=(call,))],
                                    prompt_tokens=9, cached_tokens=0, completion_tokens=20)
    outputs = {0: dataclasses.replace(source, reasoning_tokens=6)}
    [loaded] = load_outputs(dump_outputs(outputs)).values()
    assert loaded.choices == outputs[0].choices and loaded.tool_calls == (call,)
    assert (loaded.reasoning, loaded.reasoning_tokens) == ("Oslo.", 6)

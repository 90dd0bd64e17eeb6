"""The deployment bounds shards (rows and estimated tokens) whatever `shard_size` a job asks: a shard
is what a free worker slot is given, so its size bounds how long another tenant's job waits."""

from __future__ import annotations

import json

from bulkinfer.jobs.planning.shard_cost import plan_within_bounds, shard_token_cost
from bulkinfer.jobs.settings import Settings
from bulkinfer.jobs.spec import JobSpec

ROWS = 200


def _input(store) -> str:  # noqa: ANN001
    lines = [json.dumps({"q": f"question number {n:04d}"}) for n in range(ROWS)]
    store.put_bytes("in/rows.jsonl", ("\n".join(lines) + "\n").encode())
    return "in/rows.jsonl"


def _spec(**fields: object) -> JobSpec:
    return JobSpec(input_uri="/in/rows.jsonl", input_format="jsonl", model="m", prompt_column="q",
                   **fields)


def test_a_huge_shard_size_is_cut_to_the_deployments_max_shard_size(local_store) -> None:
    key = _input(local_store)
    plan = plan_within_bounds(Settings(max_shard_size=50), local_store, key, _spec(shard_size=1_000_000))
    assert [shard.estimated_rows for shard in plan] == [50] * 4
    # A job asking for smaller shards than the bound keeps its own size.
    small = plan_within_bounds(Settings(max_shard_size=50), local_store, key, _spec(shard_size=20))
    assert len(small) == 10


def test_rows_asking_many_long_samples_are_cut_into_shards_within_the_token_bound(local_store) -> None:
    key = _input(local_store)
    spec = _spec(shard_size=1_000_000, sampling={"n": 16, "max_tokens": 64})  # 1,024 tokens a row at most
    settings = Settings(max_shard_tokens=10_000)
    plan = plan_within_bounds(settings, local_store, key, spec)
    assert sum(shard.estimated_rows for shard in plan) == ROWS
    assert len(plan) >= ROWS * 1024 // 10_000
    assert all(shard_token_cost(shard, spec) <= 10_000 for shard in plan)
    # The same rows asking one short sample each fit in one shard.
    short = _spec(shard_size=1_000_000, sampling={"max_tokens": 16})
    assert len(plan_within_bounds(settings, local_store, key, short)) == 1


def test_rows_without_max_tokens_are_sized_by_the_models_expected_output_not_the_bound(local_store) -> None:
    """No max_tokens: a row may generate up to the model's context, but shards are cut by what the
    model's answers measured (the setting before that), so they stay as big as the work allows."""
    key = _input(local_store)
    unset, settings = _spec(shard_size=1_000_000), Settings(max_shard_tokens=10_000)
    assert len(plan_within_bounds(settings, local_store, key, unset, expected_output=16)) == 1
    by_setting = plan_within_bounds(settings, local_store, key, unset)  # 256 a row: ~52,000 tokens
    assert 5 <= len(by_setting) <= 7
    assert all(shard_token_cost(shard, unset) <= 10_000 for shard in by_setting)

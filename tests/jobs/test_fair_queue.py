"""The fair queue's order against a real Redis: priority first, then tenants' shares by cost (estimated
tokens), then one tenant's jobs; newcomers start level with those waiting; nothing is offered twice.
And what a shard costs, and which priority a tenant's job runs at."""

from __future__ import annotations

import redis

from bulkinfer.jobs.fair_queue import FairQueue
from bulkinfer.jobs.planning.shard_cost import shard_token_cost
from bulkinfer.jobs.planning.sharding import ShardPlan
from bulkinfer.jobs.settings import Settings
from bulkinfer.jobs.spec import JobSpec


def _drain(queue: FairQueue, model: str = "m") -> list[tuple[str, int]]:
    taken = []
    while (shard := queue.take(model)) is not None:
        taken.append((shard.job_id, shard.shard_index))
    return taken


def _queue(redis_url: str) -> FairQueue:
    return FairQueue(redis.Redis.from_url(redis_url), "test")


def test_a_small_job_behind_a_big_one_gets_the_next_free_worker(redis_url: str) -> None:
    queue = _queue(redis_url)
    for index in range(100):
        queue.offer("m", "big", index, cost=1000, priority=5, tenant="acme")
    assert [queue.take("m").job_id for _ in range(3)] == ["big"] * 3
    queue.offer("m", "small", 0, cost=100, priority=5, tenant="acme")  # same tenant, a second job
    assert queue.take("m").job_id == "small"  # it starts level with `big`, which has been charged 3000
    assert {queue.take("m").job_id for _ in range(5)} == {"big"}


def test_tenants_share_by_cost_and_priority_goes_first(redis_url: str) -> None:
    queue = _queue(redis_url)
    for index in range(4):
        queue.offer("m", "a-job", index, cost=10, priority=5, tenant="a")
    for index in range(2):
        queue.offer("m", "b-job", index, cost=20, priority=5, tenant="b")  # shards twice as big
    queue.offer("m", "urgent", 0, cost=10, priority=8, tenant="c")
    queue.offer("m", "later", 0, cost=10, priority=1, tenant="a")
    order = _drain(queue)
    assert order[0] == ("urgent", 0)
    assert order[-1] == ("later", 0)
    middle = [job for job, _ in order[1:-1]]
    # a is charged 10 a take and b 20: two of a's shards to one of b's, each in input order.
    assert middle in (["a-job", "b-job", "a-job", "a-job", "b-job", "a-job"],
                      ["b-job", "a-job", "a-job", "b-job", "a-job", "a-job"])
    assert [index for job, index in order if job == "a-job"] == [0, 1, 2, 3]


def test_offers_are_idempotent_and_a_dropped_job_yields_nothing(redis_url: str) -> None:
    queue = _queue(redis_url)
    assert queue.offer("m", "j", 0, cost=5, priority=5, tenant=None)
    assert not queue.offer("m", "j", 0, cost=5, priority=5, tenant=None)  # a planner that ran twice
    queue.offer("m", "j", 1, cost=5, priority=5, tenant=None)
    queue.offer("other-model", "k", 0, cost=5, priority=5, tenant=None)
    assert queue.waiting("m", "j") == 2
    queue.drop("m", "j")
    assert _drain(queue) == []
    assert _drain(queue, "other-model") == [("k", 0)]


def test_a_taken_shard_is_marked_started_for_the_reaper(redis_url: str) -> None:
    from bulkinfer.jobs.names import shards_started_key

    queue = _queue(redis_url)
    queue.offer("m", "job-1", 3, cost=5, priority=5, tenant=None)
    assert queue.take("m").shard_index == 3
    assert queue.client.smembers(shards_started_key("test", "job-1")) == {b"3"}


def _spec(tenant: str, **sampling: int) -> JobSpec:
    return JobSpec(input_uri="s3://in/rows.jsonl", model="m", prompt_column="q", tenant=tenant,
                   sampling={"max_tokens": 16, **sampling})


def _shard(index: int, rows: int = 4, bytes_per_row: int = 40) -> ShardPlan:
    start = index * rows * bytes_per_row
    return ShardPlan(index=index, estimated_rows=rows, rows_exact=True, byte_start=start,
                     byte_end=start + rows * bytes_per_row)


def test_a_shard_costs_its_prompt_tokens_plus_expected_output_times_n_per_row() -> None:
    # 4 rows of 40 bytes: ~10 prompt tokens each (4 bytes a token), plus what each is expected to generate.
    assert shard_token_cost(_shard(0), _spec("a")) == 4 * 10 + 4 * 16
    assert shard_token_cost(_shard(0), _spec("a", n=16)) == 4 * 10 + 4 * 16 * 16
    unset = JobSpec(input_uri="s3://in/rows.jsonl", model="m", prompt_column="q")
    # No max_tokens: the model's expected output length (the setting's 256 before it is measured),
    # never the bound (up to the model's context) and never the engine's offline default of 16.
    assert shard_token_cost(_shard(0), unset) == 4 * 10 + 4 * 256
    assert shard_token_cost(_shard(0), unset, expected_output=90) == 4 * 10 + 4 * 90
    # Rows asking for 16 but expected to stop at 9: charged 9.
    assert shard_token_cost(_shard(0), _spec("a"), expected_output=9) == 4 * 10 + 4 * 9
    scoring = JobSpec(input_uri="s3://in/rows.jsonl", model="m", prompt_column="q",
                      sampling={"max_tokens": 0, "prompt_logprobs": 1})
    assert shard_token_cost(_shard(0), scoring) == 4 * 10  # scoring only: nothing generated
    parquet = ShardPlan(index=0, estimated_rows=10, rows_exact=True, row_groups=[0], row_start=0, row_end=10)
    assert shard_token_cost(parquet, _spec("a")) == 10 * 64 + 10 * 16
    retry = _shard(0).model_copy(update={"only_rows": [40]})  # a retry runs one row of the four
    assert shard_token_cost(retry, _spec("a")) == 10 + 16


def test_a_tenant_asking_16_samples_a_row_is_charged_for_them(redis_url: str) -> None:
    """Rows alike, but a's rows ask n=16: charged by rows, a and b would alternate; charged by
    tokens, b gets a dozen shards for each of a's."""
    queue = _queue(redis_url)
    greedy, sixteen = _spec("b"), _spec("a", n=16)
    for index in range(4):
        queue.offer("m", "a-job", index, shard_token_cost(_shard(index), sixteen), priority=5, tenant="a")
    for index in range(30):
        queue.offer("m", "b-job", index, shard_token_cost(_shard(index), greedy), priority=5, tenant="b")
    order = [job for job, _ in _drain(queue)]
    first_a, second_a = [position for position, job in enumerate(order) if job == "a-job"][:2]
    assert second_a - first_a - 1 >= 9  # 1,064 tokens a shard against 104: b runs ~10 shards between
    assert order.count("b-job") == 30 and order.count("a-job") == 4


def test_a_tenants_priority_is_capped_by_the_deployment_not_the_user() -> None:
    settings = Settings(tenant_max_priority={"vip": 8})
    assert settings.job_priority(_spec("acme").model_copy(update={"priority": 9})) == 5  # default: normal
    assert settings.job_priority(_spec("acme").model_copy(update={"priority": 2})) == 2
    assert settings.job_priority(_spec("vip").model_copy(update={"priority": 9})) == 8
    admin = _spec("acme").model_copy(update={"priority": 9, "tenant": None})  # an admin's or an open API's
    assert settings.job_priority(admin) == 9
    assert Settings(default_tenant_max_priority=9).job_priority(_spec("acme").model_copy(
        update={"priority": 9})) == 9
    assert "tenant_max_priority" in settings.priority_problem("acme", 8)
    assert settings.priority_problem("vip", 8) is None

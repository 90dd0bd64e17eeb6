from collections import Counter
from collections.abc import Callable

import pytest

from bulkinfer.engine.config import EngineConfig
from bulkinfer.engine.errors import ErrorKind
from bulkinfer.engine.llm_engine import LLMEngine
from bulkinfer.engine.request import FinishReason, Request, RequestStatus
from bulkinfer.engine.sampling_params import SamplingParams
from bulkinfer.engine.scheduler import Scheduler, SchedulerOutput

EOS = 2


def next_token(request: Request) -> int:
    """The fake model's "sample": a function of the context length, never EOS."""
    return 1000 + request.num_tokens


class FakeModel:
    """Stands in for the model runner. It writes each computed token id into its KV slot and checks
    that every chunk reads back exactly its own context, so a wrong block table, a false prefix-cache
    hit or a block shared while being written fails the test."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.slots: dict[int, int] = {}
        self.prompt_tokens_computed = 0  # prompt positions run through the "model", recompute included

    def execute(self, output: SchedulerOutput) -> dict[str, int]:
        for chunk in output.chunks:  # read everything before writing anything: one forward pass
            request = chunk.request
            assert 0 not in chunk.block_ids, "the null block must never be in a block table"
            assert (
                len(chunk.block_ids) * self.block_size >= request.num_computed_tokens + chunk.num_new_tokens
            )
            for position in range(request.num_computed_tokens):
                slot = self._slot(chunk.block_ids, position)
                assert self.slots.get(slot) == request.all_token_ids[position], (request.request_id, position)
        written: set[int] = set()
        sampled = {}
        for chunk in output.chunks:
            request = chunk.request
            start, end = request.num_computed_tokens, request.num_computed_tokens + chunk.num_new_tokens
            for position in range(start, end):
                slot = self._slot(chunk.block_ids, position)
                assert slot not in written, "two chunks wrote the same KV slot in one step"
                written.add(slot)
                self.slots[slot] = request.all_token_ids[position]
            self.prompt_tokens_computed += max(0, min(end, request.num_prompt_tokens) - start)
            if end == request.num_tokens:
                sampled[request.request_id] = next_token(request)
        return sampled

    def _slot(self, block_ids: list[int], position: int) -> int:
        return block_ids[position // self.block_size] * self.block_size + position % self.block_size


def make_scheduler(num_kv_blocks: int = 64, eos_token_id: int | None = EOS, **config) -> Scheduler:
    config.setdefault("block_size", 4)
    return Scheduler(EngineConfig(model="test-model", **config), num_kv_blocks, eos_token_id)


def make_request(request_id: str, prompt: list[int], max_tokens: int = 4, **kwargs) -> Request:
    params = kwargs.pop("params", None) or SamplingParams(max_tokens=max_tokens)
    return Request(request_id, prompt, params, **kwargs)


def expected_output(prompt_len: int, max_tokens: int) -> list[int]:
    return [1000 + prompt_len + i for i in range(max_tokens)]


StepHook = Callable[[Scheduler, SchedulerOutput, set[str]], None]


def run(scheduler: Scheduler, model: FakeModel, on_step: StepHook | None = None, max_steps: int = 500):
    """Drive schedule → fake forward → update until every request finishes; check invariants."""
    finished: list[Request] = []
    outputs: list[SchedulerOutput] = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return finished, outputs
        running_before = {request.request_id for request in scheduler.running}
        output = scheduler.schedule()
        check_step_invariants(scheduler, output, running_before)
        if on_step is not None:
            on_step(scheduler, output, running_before)
        outputs.append(output)
        finished += scheduler.update_from_output(output, model.execute(output))
        check_ref_counts(scheduler)
    raise AssertionError("requests did not finish: scheduler stalled")


def check_step_invariants(scheduler: Scheduler, output: SchedulerOutput, running_before: set[str]) -> None:
    config = scheduler.config
    sizes = [chunk.num_new_tokens for chunk in output.chunks]
    assert all(size >= 1 for size in sizes)
    assert output.num_scheduled_tokens == sum(sizes) <= config.max_num_batched_tokens
    assert len(output.chunks) <= config.max_num_seqs and len(scheduler.running) <= config.max_num_seqs
    ids = [chunk.request.request_id for chunk in output.chunks]
    assert len(ids) == len(set(ids))
    was_running = [request_id in running_before for request_id in ids]
    assert was_running == sorted(was_running, reverse=True), "running requests must come first"
    if output.preempted_ids:
        assert all(was_running), "no admission in a step that preempted"
        assert not set(output.preempted_ids) & set(ids)


def check_ref_counts(scheduler: Scheduler) -> None:
    holders = Counter(block_id for request in scheduler.running for block_id in request.block_ids)
    pool = scheduler.kv_cache_manager.block_pool
    for block in pool.blocks[1:]:
        assert block.ref_cnt == holders[block.block_id], block
    assert pool.num_free_blocks == pool.num_usable_blocks - len(holders)


# ---- budget, order, chunked prefill --------------------------------------------------------------


def test_single_request_prefills_then_decodes_and_finishes_with_length():
    scheduler = make_scheduler()
    request = make_request("a", [5, 6, 7], max_tokens=3)
    assert scheduler.add_request(request)
    finished, outputs = run(scheduler, FakeModel(4))
    assert finished == [request]
    assert [[c.num_new_tokens for c in o.chunks] for o in outputs] == [[3], [1], [1]]
    assert request.output_token_ids == expected_output(3, 3)
    assert request.finish_reason == FinishReason.LENGTH and request.status is RequestStatus.FINISHED_LENGTH
    assert request.block_ids == [] and scheduler.kv_cache_usage == 0.0


def test_chunked_prefill_splits_a_long_prompt_under_a_budget_of_7():
    scheduler = make_scheduler(max_num_batched_tokens=7)
    request = make_request("a", list(range(100, 120)), max_tokens=2)
    scheduler.add_request(request)
    finished, outputs = run(scheduler, FakeModel(4))
    assert [o.num_scheduled_tokens for o in outputs] == [7, 7, 6, 1]
    assert request.output_token_ids == expected_output(20, 2)


def test_running_first_then_waiting_within_the_budget():
    scheduler = make_scheduler(max_num_batched_tokens=10)
    for name in "abc":
        scheduler.add_request(make_request(name, [ord(name)] * 6, max_tokens=3))
    steps = []

    def record(_scheduler, output, _running_before):
        steps.append([(c.request.request_id, c.num_new_tokens) for c in output.chunks])

    finished, _ = run(scheduler, FakeModel(4), record)
    assert steps[0] == [("a", 6), ("b", 4)]  # b's prompt is chunked to fit the budget
    assert steps[1] == [("a", 1), ("b", 2), ("c", 6)]  # running (decode + rest of prefill) first
    assert sorted(r.request_id for r in finished) == ["a", "b", "c"]
    assert all(r.output_token_ids == expected_output(6, 3) for r in finished)


def _decodes_and_prompts(output: SchedulerOutput) -> tuple[list[str], list[str]]:
    """The ids of this step's decode chunks and of its prompt chunks."""
    decodes = [c.request.request_id for c in output.chunks
               if c.num_new_tokens == 1 and c.request.num_computed_tokens >= c.request.num_prompt_tokens]
    return decodes, [c.request.request_id for c in output.chunks if c.request.request_id not in decodes]


def test_a_submitted_batch_prefills_first_while_its_prompts_fill_whole_steps():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    for name in "abcde":
        scheduler.add_request(make_request(name, [ord(name)] * 8, max_tokens=3))
    steps = []
    finished, _ = run(scheduler, FakeModel(4), lambda _s, out, _r: steps.append(_decodes_and_prompts(out)))
    # a, b, c, d and e's prompts each fill a step: the decodes that become ready wait until the last
    assert steps[:5] == [([], [name]) for name in "abcde"]
    assert steps[5] == (list("abcde"), [])
    assert all(r.output_token_ids == expected_output(8, 3) for r in finished) and len(finished) == 5


def test_decodes_are_not_held_back_for_prompts_smaller_than_a_step():
    scheduler = make_scheduler(max_num_batched_tokens=10)
    scheduler.add_request(make_request("a", [7] * 6, max_tokens=4))
    steps = []

    def record(sched: Scheduler, output: SchedulerOutput, _running: set[str]) -> None:
        steps.append(_decodes_and_prompts(output))
        if len(steps) == 2:
            sched.add_request(make_request("b", [8] * 5, max_tokens=2))  # a trickle: half a step

    run(scheduler, FakeModel(4), record)
    assert steps[2] == (["a"], ["b"])


def test_a_less_urgent_batch_does_not_hold_back_running_decodes():
    scheduler = make_scheduler(max_num_batched_tokens=8, scheduling_policy="priority")
    scheduler.add_request(make_request("urgent", [5] * 8, max_tokens=4, priority=0))
    steps = []

    def record(sched: Scheduler, output: SchedulerOutput, _running: set[str]) -> None:
        steps.append(_decodes_and_prompts(output))
        if len(steps) == 1:
            for index in range(4):
                sched.add_request(make_request(f"later{index}", [9 + index] * 8, max_tokens=2, priority=5))

    run(scheduler, FakeModel(4), record)
    assert all("urgent" in decodes for decodes, _ in steps[1:4])


def test_decodes_are_not_held_back_when_free_kv_blocks_are_short():
    # 8 usable blocks of 4 tokens: once a and b hold theirs, a step's prompt blocks plus a block of
    # headroom for every request's next token no longer fit, so the decodes run beside the next prompt.
    scheduler = make_scheduler(num_kv_blocks=9, max_num_batched_tokens=8, kv_growth_reserve_tokens=0)
    for name in "abcd":
        scheduler.add_request(make_request(name, [ord(name)] * 8, max_tokens=2))
    steps = []
    finished, _ = run(scheduler, FakeModel(4), lambda _s, out, _r: steps.append(_decodes_and_prompts(out)))
    assert steps[1] == ([], ["b"])  # 6 free blocks >= 3 for b's prompt + 1 each for a's and b's next token
    assert steps[2] == (["a", "b"], ["c"])  # 4 free < 3 + 3
    assert len(finished) == 4 and scheduler.num_preemptions == 0


def test_max_num_seqs_limits_admission():
    scheduler = make_scheduler(max_num_seqs=2)
    for index in range(5):
        scheduler.add_request(make_request(f"r{index}", [index + 10] * 3, max_tokens=2))
    finished, outputs = run(scheduler, FakeModel(4))
    assert max(len(o.chunks) for o in outputs) == 2
    assert len(finished) == 5


# ---- preemption ----------------------------------------------------------------------------------


def test_preemption_with_a_tiny_pool_recomputes_and_finishes_everything():
    # 6 usable blocks of 4 = 24 slots; each request needs up to 4 + 7 = 11 slots (3 blocks). No
    # growth reserve: all four are admitted and push each other out as they grow.
    scheduler = make_scheduler(num_kv_blocks=7, kv_growth_reserve_tokens=0)
    requests = [make_request(f"r{i}", [10 * i + j for j in range(4)], max_tokens=8) for i in range(4)]
    for request in requests:
        scheduler.add_request(request)
    preempting_steps = []

    def check_preemption(sched, output, _running_before):
        if output.preempted_ids:
            preempting_steps.append(output.preempted_ids)
            assert sched.waiting.peek().request_id == output.preempted_ids[-1]
            assert sched.get_request(output.preempted_ids[-1]).status is RequestStatus.PREEMPTED

    finished, _ = run(scheduler, FakeModel(4), check_preemption)
    assert scheduler.num_preemptions > 0 and preempting_steps
    assert len(finished) == 4
    for request in requests:
        assert request.output_token_ids == expected_output(4, 8)
        assert request.finish_reason == FinishReason.LENGTH
    assert sum(r.num_preemptions for r in requests) == scheduler.num_preemptions
    assert scheduler.kv_cache_usage == 0.0


def test_admission_leaves_running_requests_room_to_finish_instead_of_preempting_them():
    # The tiny pool above (6 usable blocks, 4 requests of up to 11 tokens = 3 blocks each), with the
    # default growth reserve: two run at a time and grow to their ends; nothing is computed twice.
    scheduler = make_scheduler(num_kv_blocks=7)
    requests = [make_request(f"r{i}", [10 * i + j for j in range(4)], max_tokens=8) for i in range(4)]
    for request in requests:
        scheduler.add_request(request)
    running = []
    finished, outputs = run(scheduler, FakeModel(4), lambda s, _o, _r: running.append(len(s.running)))
    assert scheduler.num_preemptions == 0 and len(finished) == 4
    assert max(running) == 2
    assert sum(o.num_scheduled_tokens for o in outputs) == 4 * (4 + 7)  # each prompt and decode once
    for request in requests:
        assert request.output_token_ids == expected_output(4, 8)


def test_the_growth_reserve_is_a_window_not_the_whole_max_tokens():
    # 15 usable blocks of 4; prompts of 4 with max_tokens 200 (a loose cap). A 4-token window keeps
    # 1-2 blocks per running request, so all four run at once; reserving their whole max_tokens
    # would admit them one at a time.
    scheduler = make_scheduler(num_kv_blocks=16, kv_growth_reserve_tokens=4)
    for i in range(4):
        scheduler.add_request(make_request(f"r{i}", [10 * i + j for j in range(4)], max_tokens=200))
    output = scheduler.schedule()
    assert [c.request.request_id for c in output.chunks] == ["r0", "r1", "r2", "r3"]


def test_fcfs_preempts_the_last_running_request_and_puts_it_at_the_front():
    scheduler = make_scheduler(num_kv_blocks=4, kv_growth_reserve_tokens=0)  # 3 usable blocks
    first = make_request("first", [1, 2, 3, 4], max_tokens=6)
    second = make_request("second", [5, 6, 7, 8], max_tokens=6)
    third = make_request("third", [9], max_tokens=1)
    for request in (first, second, third):
        scheduler.add_request(request)
    model = FakeModel(4)
    output = scheduler.schedule()  # one block each; third samples its only token and finishes
    assert [c.request.request_id for c in output.chunks] == ["first", "second", "third"]
    scheduler.update_from_output(output, model.execute(output))
    # Both now need a second block for their first decode, and one block is free.
    output = scheduler.schedule()
    assert output.preempted_ids == ["second"]
    assert [c.request.request_id for c in output.chunks] == ["first"]
    assert scheduler.waiting.peek() is second and second.num_computed_tokens == 0
    assert second.all_token_ids == [5, 6, 7, 8, *expected_output(4, 1)] and second.block_ids == []
    scheduler.update_from_output(output, model.execute(output))
    run(scheduler, model)
    assert second.output_token_ids == expected_output(4, 6)
    assert first.output_token_ids == expected_output(4, 6)


def test_no_admission_in_a_step_that_preempted():
    # Priority policy, so a small urgent request can be first in line once "low" is preempted.
    scheduler = make_scheduler(num_kv_blocks=4, scheduling_policy="priority", max_num_seqs=2,
                               kv_growth_reserve_tokens=0)
    high = make_request("high", [1, 2, 3, 4], max_tokens=4, priority=0, arrival_time=0.0)
    low = make_request("low", [5, 6, 7, 8], max_tokens=4, priority=5, arrival_time=1.0)
    scheduler.add_request(high)
    scheduler.add_request(low)
    model = FakeModel(4)
    output = scheduler.schedule()
    scheduler.update_from_output(output, model.execute(output))
    # "small" waits only for a sequence slot; it would fit in the block "low" frees.
    small = make_request("small", [9], max_tokens=1, priority=1, arrival_time=2.0)
    scheduler.add_request(small)
    output = scheduler.schedule()
    assert output.preempted_ids == ["low"]
    assert [c.request.request_id for c in output.chunks] == ["high"]
    scheduler.update_from_output(output, model.execute(output))
    output = scheduler.schedule()
    assert [c.request.request_id for c in output.chunks] == ["high", "small"]
    scheduler.update_from_output(output, model.execute(output))
    run(scheduler, model)
    assert low.output_token_ids == expected_output(4, 4) and small.output_token_ids == expected_output(1, 1)


def test_preempted_request_recompute_hits_its_own_cached_blocks():
    scheduler = make_scheduler(num_kv_blocks=5, kv_growth_reserve_tokens=0)  # 4 usable blocks
    hog = make_request("hog", list(range(8)), max_tokens=2)  # 2 blocks, then a 3rd to decode
    victim = make_request("victim", list(range(50, 55)), max_tokens=8)  # 2 blocks
    scheduler.add_request(hog)
    scheduler.add_request(victim)
    victim_chunks = []

    def note(_sched, output, _running_before):
        victim_chunks.extend(
            (c.request.num_computed_tokens, c.num_new_tokens) for c in output.chunks if c.request is victim
        )

    run(scheduler, FakeModel(4), note)
    assert victim.num_preemptions == 1
    # Prefill 5, then preempted holding 6 tokens; the recompute hits its full block [50..53]
    # and computes only tokens 4 and 5.
    assert victim_chunks[:2] == [(0, 5), (4, 2)]
    assert victim.output_token_ids == expected_output(5, 8)
    assert victim.num_cached_tokens == 0  # a recompute is not a prompt-cache hit


def test_request_larger_than_the_pool_finishes_with_length_instead_of_deadlocking():
    scheduler = make_scheduler(num_kv_blocks=5)  # 16 slots: at most 17 tokens in all
    request = make_request("big", list(range(10)), params=SamplingParams(max_tokens=100, ignore_eos=True))
    other = make_request("other", list(range(30, 33)), max_tokens=3)
    scheduler.add_request(request)
    scheduler.add_request(other)
    finished, _ = run(scheduler, FakeModel(4))
    assert request.finish_reason == FinishReason.LENGTH and request.num_tokens == 17
    assert other.output_token_ids == expected_output(3, 3)
    too_long = make_request("too-long", list(range(17)))
    assert not scheduler.add_request(too_long)
    assert too_long.finish_reason == FinishReason.ERROR and "KV cache holds only 16" in too_long.error


# ---- priority ------------------------------------------------------------------------------------


def test_priority_policy_admits_lowest_priority_value_then_earliest_arrival():
    scheduler = make_scheduler(scheduling_policy="priority", max_num_seqs=1)
    order = [("late-urgent", 0, 3.0), ("normal", 5, 1.0), ("early-urgent", 0, 2.0), ("lazy", 9, 0.0)]
    for name, priority, arrival in order:
        scheduler.add_request(
            make_request(name, [7, 7], max_tokens=1, priority=priority, arrival_time=arrival)
        )
    finished, _ = run(scheduler, FakeModel(4))
    assert [r.request_id for r in finished] == ["early-urgent", "late-urgent", "normal", "lazy"]


def test_priority_policy_preempts_the_highest_priority_value():
    scheduler = make_scheduler(num_kv_blocks=4, scheduling_policy="priority")  # 3 usable blocks
    model = FakeModel(4)
    background = make_request("background", [1, 2, 3, 4], max_tokens=8, priority=5, arrival_time=0.0)
    scheduler.add_request(background)
    output = scheduler.schedule()
    scheduler.update_from_output(output, model.execute(output))
    urgent = make_request("urgent", [5, 6, 7, 8], max_tokens=8, priority=0, arrival_time=1.0)
    scheduler.add_request(urgent)
    preempted = []
    run(scheduler, model, lambda _s, out, _r: preempted.extend(out.preempted_ids))
    assert preempted and set(preempted) == {"background"}
    assert urgent.num_preemptions == 0
    assert background.output_token_ids == expected_output(4, 8)


# ---- stop conditions, errors, abort --------------------------------------------------------------


def test_stop_conditions_in_order():
    scheduler = make_scheduler(max_model_len=8)
    stop_id = make_request("stop-id", [1, 2, 3], params=SamplingParams(max_tokens=10, stop_token_ids=[1005]))
    eos = make_request("eos", [1, 2, 3, 4], params=SamplingParams(max_tokens=10))
    ignore = make_request("ignore", [1, 2, 3, 4], params=SamplingParams(max_tokens=2, ignore_eos=True))
    both = make_request("both", [9, 9], params=SamplingParams(max_tokens=1, stop_token_ids=[1002]))
    model_len = make_request("model-len", [5, 5, 5], params=SamplingParams(max_tokens=50))
    for request in (stop_id, eos, ignore, both, model_len):
        assert scheduler.add_request(request)
    for _ in range(20):
        if not scheduler.has_unfinished_requests():
            break
        output = scheduler.schedule()
        sampled = {}  # scripted: EOS for two requests, the fake model's token for the others
        for chunk in output.chunks:
            request = chunk.request
            if request.num_computed_tokens + chunk.num_new_tokens == request.num_tokens:
                sampled[request.request_id] = (
                    EOS if request.request_id in ("eos", "ignore") else next_token(request)
                )
        scheduler.update_from_output(output, sampled)
    assert stop_id.finish_reason == FinishReason.STOP and stop_id.output_token_ids == [1003, 1004, 1005]
    assert eos.finish_reason == FinishReason.STOP and eos.output_token_ids == [EOS]
    assert ignore.finish_reason == FinishReason.LENGTH and ignore.output_token_ids == [EOS, EOS]
    assert both.finish_reason == FinishReason.STOP  # stop token beats max_tokens
    assert model_len.finish_reason == FinishReason.LENGTH and model_len.num_tokens == 8


@pytest.mark.parametrize(
    ("prompt", "kind", "message"),
    [
        ([], ErrorKind.EMPTY_PROMPT, "prompt is empty"),
        (list(range(8)), ErrorKind.PROMPT_TOO_LONG, "exceeds max_model_len=8"),
        ([1, -3], ErrorKind.INVALID_PROMPT, "negative token id"),
    ],
)
def test_invalid_requests_finish_with_an_error_and_others_keep_running(prompt, kind, message):
    """(Invalid SamplingParams are the engine's to refuse, once: tests/engine/test_engine_errors.py.)"""
    scheduler = make_scheduler(max_model_len=8)
    good = make_request("good", [3, 4, 5], max_tokens=2)
    scheduler.add_request(good)
    bad = make_request("bad", prompt, params=SamplingParams())
    assert scheduler.add_request(bad) is False
    assert bad.finish_reason == FinishReason.ERROR and bad.status is RequestStatus.FINISHED_ERROR
    assert message in bad.error and bad.error_kind == kind
    assert scheduler.get_request("bad") is None and scheduler.num_waiting == 1
    finished, _ = run(scheduler, FakeModel(4))
    assert finished == [good] and good.output_token_ids == expected_output(3, 2)


def test_add_request_raises_on_caller_bugs():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", [1]))
    with pytest.raises(ValueError, match="already in the scheduler"):
        scheduler.add_request(make_request("a", [2]))
    finished = make_request("b", [1])
    finished.finish(FinishReason.ABORT, 0.0)
    with pytest.raises(ValueError, match="not fresh"):
        scheduler.add_request(finished)


def test_abort_frees_blocks_and_skips_waiting_requests():
    scheduler = make_scheduler(max_num_seqs=1)
    running = make_request("running", list(range(9)), max_tokens=5)
    waiting = make_request("waiting", [4, 4], max_tokens=2)
    later = make_request("later", [5, 5], max_tokens=2)
    for request in (running, waiting, later):
        scheduler.add_request(request)
    model = FakeModel(4)
    output = scheduler.schedule()
    scheduler.update_from_output(output, model.execute(output))
    assert scheduler.kv_cache_manager.num_free_blocks < 63
    assert scheduler.abort_request("running") is running
    assert running.finish_reason == FinishReason.ABORT and running.block_ids == []
    assert scheduler.kv_cache_manager.num_free_blocks == 63 and scheduler.num_running == 0
    assert scheduler.abort_request("waiting") is waiting and scheduler.num_waiting == 1
    assert scheduler.abort_request("waiting") is None and scheduler.abort_request("nope") is None
    finished, outputs = run(scheduler, model)
    assert finished == [later]
    assert all(c.request is later for o in outputs for c in o.chunks)


def test_abort_between_schedule_and_update_is_ignored_by_update():
    scheduler = make_scheduler()
    request = make_request("a", [1, 2, 3])
    scheduler.add_request(request)
    output = scheduler.schedule()
    sampled = FakeModel(4).execute(output)
    scheduler.abort_request("a")
    assert scheduler.update_from_output(output, sampled) == []
    assert request.output_token_ids == [] and not scheduler.has_unfinished_requests()


def test_missing_sampled_token_is_a_caller_error():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", [1, 2, 3]))
    output = scheduler.schedule()
    with pytest.raises(ValueError, match="no sampled token"):
        scheduler.update_from_output(output, {})


def test_timings_are_recorded():
    scheduler = make_scheduler()
    request = make_request("a", [1, 2, 3], max_tokens=3)
    scheduler.add_request(request)
    run(scheduler, FakeModel(4))
    assert request.arrival_time <= request.first_scheduled_time <= request.first_token_time
    assert len(request.token_times) == 3 and request.token_times == sorted(request.token_times)
    assert request.last_token_time <= request.finished_time


# ---- shared prefixes -----------------------------------------------------------------------------

PREFIX = list(range(500, 564))  # 64 tokens = 4 blocks of 16


def shared_prefix_requests(count: int = 8, tail_len: int = 8) -> list[Request]:
    return [
        make_request(f"r{i}", PREFIX + [2000 + 100 * i + j for j in range(tail_len)], max_tokens=3)
        for i in range(count)
    ]


@pytest.mark.parametrize("budget", [2048, 20])
def test_shared_prefix_admitted_together_is_computed_once(budget):
    scheduler = make_scheduler(block_size=16, max_num_batched_tokens=budget)
    requests = shared_prefix_requests()
    for request in requests:
        scheduler.add_request(request)
    model = FakeModel(16)
    finished, outputs = run(scheduler, model)
    assert model.prompt_tokens_computed == 64 + 8 * 8  # the prefix once, every tail once
    assert scheduler.kv_cache_manager.prefix_cache_hits == 7 * 64
    assert scheduler.kv_cache_manager.prefix_cache_queries == 8 * 72
    assert sorted(r.num_cached_tokens for r in requests) == [0] + [64] * 7
    assert all(r.output_token_ids == expected_output(72, 3) for r in requests)
    if budget == 2048:
        assert len(outputs[0].chunks) == 1  # the others waited one step for the prefix
        assert len(outputs[1].chunks) == 8


def test_hold_back_only_applies_to_requests_that_share_the_block_in_flight():
    scheduler = make_scheduler(block_size=16)
    sharing = shared_prefix_requests(2)
    unrelated = make_request("unrelated", list(range(3000, 3040)), max_tokens=3)
    for request in (*sharing, unrelated):
        scheduler.add_request(request)
    output = scheduler.schedule()
    assert [c.request.request_id for c in output.chunks] == ["r0", "unrelated"]
    assert scheduler.waiting.peek() is sharing[1]  # held back, still first in line


def test_prefix_caching_disabled_computes_every_prompt():
    scheduler = make_scheduler(block_size=16, enable_prefix_caching=False)
    for request in shared_prefix_requests():
        scheduler.add_request(request)
    model = FakeModel(16)
    _, outputs = run(scheduler, model)
    assert model.prompt_tokens_computed == 8 * 72 and len(outputs[0].chunks) == 8
    assert scheduler.kv_cache_manager.prefix_cache_hits == 0


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("block_size", 0, "block_size must be >= 1, got 0"),
        ("max_num_batched_tokens", True, "max_num_batched_tokens must be an integer, got True"),
        ("max_num_seqs", 0, "max_num_seqs must be >= 1, got 0"),
        ("max_model_len", 1, "max_model_len must be >= 2, got 1"),
        ("kv_cache_memory", 1.5, "kv_cache_memory as a fraction must be in (0, 1], got 1.5"),
        ("kv_cache_memory", -1, "kv_cache_memory in bytes must be > 0, got -1"),
        ("num_kv_blocks", 1, "num_kv_blocks must be >= 2, got 1"),
        ("kv_populate_seconds", -1, "kv_populate_seconds must be a finite number of seconds >= 0, got -1"),
        ("kv_populate_seconds", float("inf"), "kv_populate_seconds must be a finite number"),
        ("kv_populate_seconds", "3", "kv_populate_seconds must be a finite number"),
        ("kv_growth_reserve_tokens", -1, "kv_growth_reserve_tokens must be >= 0, got -1"),
        ("dtype", "fp8", "dtype must be one of"),
        ("scheduling_policy", "lifo", "scheduling_policy must be one of"),
        ("model", "", "model must be a non-empty string"),
    ],
)
def test_the_engine_rejects_an_invalid_config_before_loading_anything(field, value, message):
    """Validated once, by its owner (the scheduler takes a valid config)."""
    config = EngineConfig(model="no/such/model")
    setattr(config, field, value)
    with pytest.raises(ValueError) as excinfo:
        LLMEngine(config)
    assert message in str(excinfo.value)


def test_every_kind_of_kv_budget_is_valid_and_its_neighbours_are_not():
    for kv_cache_memory in (None, 1 << 30, 0.5, 1.0):  # default, bytes, fractions up to all of it
        EngineConfig(model="m", kv_cache_memory=kv_cache_memory, scheduling_policy="priority").validate()
    for kv_cache_memory in (0, 0.0, 1.01, -5, "1G"):
        with pytest.raises(ValueError, match="kv_cache_memory"):
            EngineConfig(model="m", kv_cache_memory=kv_cache_memory).validate()

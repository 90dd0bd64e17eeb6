"""At most max_loras adapters in a step, no adapter starved, base rows unlimited; adapters in host
memory kept least recently used up to max_cpu_loras, never one a live request uses."""

from __future__ import annotations

import pytest

from bulkinfer.engine import LLM, LoRARequest, SamplingParams
from tests.engine.lora_adapters import make_adapter
from tests.engine.test_scheduler import FakeModel, make_request, make_scheduler


def lora(lora_id: int) -> LoRARequest:
    return LoRARequest(f"adapter-{lora_id}", lora_id, f"/adapters/{lora_id}")


def running_adapters(scheduler) -> set[int]:
    return {r.lora_request.lora_int_id for r in scheduler.running if r.lora_request is not None}


def drive(scheduler, model, steps: int, each_step=None) -> list[str]:
    """Run up to `steps` steps; returns finished request ids in order."""
    finished = []
    for step in range(steps):
        if each_step is not None:
            each_step(step)
        output = scheduler.schedule()
        assert len(running_adapters(scheduler)) <= scheduler.config.max_loras
        finished += [r.request_id for r in scheduler.update_from_output(output, model.execute(output))]
        if not scheduler.has_unfinished_requests():
            break
    return finished


def test_a_step_runs_at_most_max_loras_adapters_and_any_number_of_base_rows():
    scheduler = make_scheduler(enable_lora=True, max_loras=2)
    for i in range(16):
        adapter = None if i % 4 == 3 else lora(1 + i % 4)
        scheduler.add_request(make_request(str(i), [10 + i] * 6, lora_request=adapter))
    model = FakeModel(4)
    first = scheduler.schedule()
    assert {c.request.lora_request.lora_int_id for c in first.chunks if c.request.lora_request} == {1, 2}
    assert sum(1 for c in first.chunks if c.request.lora_request is None) == 4  # every base row
    finished = [r.request_id for r in scheduler.update_from_output(first, model.execute(first))]
    finished += drive(scheduler, model, 200)
    assert len(finished) == 16


def test_a_blocked_adapter_gets_a_slot_while_rows_of_the_running_one_keep_coming():
    scheduler = make_scheduler(enable_lora=True, max_loras=1)
    model = FakeModel(4)

    def one_more_row_of_adapter_1(step: int) -> None:
        scheduler.add_request(make_request(f"a1-{step}", [7, step % 50 + 8, 9], lora_request=lora(1)))
        if step == 1:
            scheduler.add_request(make_request("a2", [5, 6, 7], lora_request=lora(2)))

    finished = drive(scheduler, model, 30, one_more_row_of_adapter_1)
    # Adapter 1's rows admitted before the blocked one finish (4 tokens), then adapter 2 runs.
    assert "a2" in finished and finished.index("a2") < 12
    assert scheduler.lora_admission.draining in (None, 1)


def test_without_enable_lora_nothing_is_gated():
    scheduler = make_scheduler()
    assert scheduler.lora_admission is None


@pytest.fixture(scope="module")
def three_adapters(checkpoint_factory) -> tuple[str, list[LoRARequest]]:
    base = str(checkpoint_factory(arch="llama"))
    made = [make_adapter(base, seed)[0] for seed in (21, 22, 23)]
    return base, [LoRARequest(f"h{i}", i + 1, str(path)) for i, path in enumerate(made)]


def test_host_memory_keeps_the_least_recently_used_up_to_max_cpu_loras(three_adapters):
    base, (a, b, c) = three_adapters
    llm = LLM(model=base, dtype="float32", num_kv_blocks=32, enable_lora=True, max_loras=1, max_cpu_loras=2)
    manager = llm.engine.lora
    params = SamplingParams(temperature=0.0, max_tokens=2)
    for request in (a, b, a, c):
        llm.generate([[5, 6, 7, 8]], params, lora_request=request)
    assert manager.host_adapter_ids == [1, 3]  # b was the least recently used
    # Adapters that queued requests use stay, even beyond max_cpu_loras.
    for request in (b, a, c):
        llm.engine.add_request(request.lora_name, [5, 6, 7], params, lora_request=request)
    assert sorted(manager.host_adapter_ids) == [1, 2, 3]
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert len(manager.host_adapter_ids) == 2  # back within the limit once it finished


def test_with_async_scheduling_a_finished_rows_adapter_keeps_its_slot_while_its_step_is_in_flight():
    """Step N+1 is scheduled before step N's outputs are taken; a row that step N-1 finished may
    still be in step N, reading its adapter's slot: no new adapter takes that slot until step N is
    taken."""
    scheduler = make_scheduler(enable_lora=True, max_loras=1)
    # x stops at its first token, which the second step runs ahead of.
    stops_first = SamplingParams(max_tokens=4, stop_token_ids=[1003])
    scheduler.add_request(make_request("x", [5, 6, 7], params=stops_first, lora_request=lora(1)))
    first = scheduler.schedule()
    scheduler.commit_in_flight(first)
    scheduler.add_request(make_request("y", [8, 9, 10], max_tokens=2, lora_request=lora(2)))
    second = scheduler.schedule()  # x runs ahead (its first token still on the device); y waits
    assert [c.request.request_id for c in second.chunks] == ["x"]
    scheduler.commit_in_flight(second)
    finished = scheduler.update_from_output(first, {"x": 1003}, committed=True)
    assert [r.request_id for r in finished] == ["x"]  # stopped at its first token; still in `second`
    third = scheduler.schedule()
    assert not third.chunks  # adapter 2 waits for `second`, which reads adapter 1's slot
    scheduler.update_from_output(second, {"x": 1004}, committed=True)
    fourth = scheduler.schedule()
    assert [c.request.request_id for c in fourth.chunks] == ["y"]


def test_a_slot_the_step_in_flight_reads_is_never_reloaded(three_adapters):
    """The manager's own guard behind the scheduler's: with steps overlapping, a new adapter may
    not take a slot of the step in flight (a bug upstream fails loudly instead of corrupting it)."""
    base, (a, b, c) = three_adapters
    llm = LLM(model=base, dtype="float32", num_kv_blocks=32, enable_lora=True, max_loras=2)
    manager = llm.engine.lora
    manager.begin_step()
    assert {manager.slot_of(a), manager.slot_of(b)} == {0, 1}
    manager.keep_in_flight_slots = True
    manager.begin_step()  # a and b's step is in flight now
    assert manager.slot_of(a) in (0, 1)  # loaded already: reading is fine
    with pytest.raises(RuntimeError, match="more than max_loras"):
        manager.slot_of(c)
    manager.keep_in_flight_slots = False
    manager.begin_step()  # synchronous: the step before is done, its slots free to reload
    assert manager.slot_of(c) in (0, 1)

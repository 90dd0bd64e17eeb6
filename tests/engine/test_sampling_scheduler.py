"""Scheduler hooks for sampling: finish_request from outside a step, can_admit, min_tokens."""

from __future__ import annotations

from bulkinfer.engine.request import FinishReason, RequestStatus
from bulkinfer.engine.sampling_params import SamplingParams
from tests.engine.test_scheduler import EOS, FakeModel, make_request, make_scheduler


def test_finish_request_frees_a_running_or_waiting_request_with_its_reason():
    scheduler = make_scheduler(num_kv_blocks=16, max_num_seqs=1)
    model = FakeModel(4)
    running = make_request("running", list(range(10, 19)), max_tokens=20)
    waiting = make_request("waiting", list(range(30, 35)), max_tokens=20)
    scheduler.add_request(running)
    scheduler.add_request(waiting)
    output = scheduler.schedule()
    scheduler.update_from_output(output, model.execute(output))
    free = scheduler.kv_cache_manager.num_free_blocks
    assert running.status is RequestStatus.RUNNING and running.block_ids

    assert scheduler.finish_request("running", FinishReason.STOP) is running
    assert running.finish_reason is FinishReason.STOP and running.block_ids == []
    assert scheduler.kv_cache_manager.num_free_blocks > free and scheduler.num_running == 0
    assert scheduler.finish_request("waiting", FinishReason.ERROR, "grammar failed") is waiting
    assert waiting.error == "grammar failed" and scheduler.num_waiting == 0
    assert not scheduler.has_unfinished_requests()
    assert scheduler.finish_request("running", FinishReason.STOP) is None
    assert (
        scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_manager.block_pool.num_usable_blocks
    )


def test_can_admit_skips_a_request_keeping_its_place():
    scheduler = make_scheduler()
    model = FakeModel(4)
    blocked = {"first"}
    scheduler.can_admit = lambda request: request.request_id not in blocked
    for name in ("first", "second", "third"):
        scheduler.add_request(make_request(name, [7, 8, 9], max_tokens=3))
    output = scheduler.schedule()
    assert [c.request.request_id for c in output.chunks] == ["second", "third"]
    scheduler.update_from_output(output, model.execute(output))
    assert scheduler.num_waiting == 1 and scheduler.get_request("first").status is RequestStatus.WAITING
    blocked.clear()
    output = scheduler.schedule()
    assert [c.request.request_id for c in output.chunks] == ["second", "third", "first"]


def test_stop_tokens_do_not_end_a_request_before_min_tokens():
    scheduler = make_scheduler()
    params = SamplingParams(max_tokens=5, min_tokens=2, stop_token_ids=[77])
    request = make_request("r", [1, 2, 3], params=params)
    scheduler.add_request(request)
    for token in (EOS, 77):  # (the sampler masks these; a forced one is still not a stop)
        output = scheduler.schedule()
        assert scheduler.update_from_output(output, {"r": token}) == []
    output = scheduler.schedule()
    assert scheduler.update_from_output(output, {"r": 77}) == [request]
    assert request.finish_reason is FinishReason.STOP and request.stop_reason == 77
    assert request.stopped_on_token

"""The consumer watchdog (worker/process/consumer_watchdog.py): a worker whose consumer stalled
(messages waiting, a thread free, nothing received) stops itself; a busy or fed worker never does."""

from __future__ import annotations

import threading
import time

from bulkinfer.worker.process.consumer_watchdog import ConsumerActivity, stalled, watch


def test_messages_waiting_with_a_free_thread_and_nothing_received_is_a_stall() -> None:
    activity = ConsumerActivity(last_received=100.0)
    assert stalled(activity, concurrency=2, waiting=3, waiting_since=100.0, now=161.0)
    assert not stalled(activity, concurrency=2, waiting=3, waiting_since=100.0, now=159.0)  # not long enough
    assert not stalled(activity, concurrency=2, waiting=0, waiting_since=None, now=500.0)  # nothing waits
    activity.received()  # a message just came in: the consumer lives
    assert not stalled(activity, concurrency=2, waiting=3, waiting_since=100.0, now=time.monotonic() + 1)
    busy = ConsumerActivity(last_received=0.0)
    busy.started()
    busy.started()  # every thread busy: messages wait for them, not for the consumer
    assert not stalled(busy, concurrency=2, waiting=5, waiting_since=0.0, now=1000.0)
    busy.finished()
    assert stalled(busy, concurrency=2, waiting=5, waiting_since=0.0, now=1000.0)


def test_the_watch_stops_a_stalled_worker_once_and_never_one_that_keeps_receiving() -> None:
    reasons: list[str] = []
    stalled_activity = ConsumerActivity()
    queues = ["bulkinfer.control", "bulkinfer.model.tiny"]
    watch(stalled_activity, queues, 2, lambda queue: 1, threading.Event(), on_stall=reasons.append,
          every_s=0.01, stall_s=0.05)
    assert len(reasons) == 1
    assert "2 message(s) waited in bulkinfer.control, bulkinfer.model.tiny" in reasons[0]
    assert "the broker consumer has stalled" in reasons[0]

    fed, stop, fed_reasons = ConsumerActivity(), threading.Event(), []
    thread = threading.Thread(target=watch, args=(fed, ["q"], 2, lambda queue: 1, stop),
                              kwargs={"on_stall": fed_reasons.append, "every_s": 0.01, "stall_s": 0.1})
    thread.start()
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:
        fed.received()
        time.sleep(0.01)
    stop.set()
    thread.join(2)
    assert fed_reasons == []


def test_a_broker_that_cannot_be_asked_is_no_stall() -> None:
    def down(queue: str) -> int:
        raise ConnectionError("refused")

    stop, reasons = threading.Event(), []
    thread = threading.Thread(target=watch, args=(ConsumerActivity(), ["q"], 2, down, stop),
                              kwargs={"on_stall": reasons.append, "every_s": 0.01, "stall_s": 0.02})
    thread.start()
    time.sleep(0.2)
    stop.set()
    thread.join(2)
    assert reasons == []

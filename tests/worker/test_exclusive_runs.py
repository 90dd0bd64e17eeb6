"""A split shard's delivery runs alone in its worker process (worker/shards/exclusive_runs.py)."""

from __future__ import annotations

import threading
import time

from bulkinfer.worker.shards.exclusive_runs import ExclusiveRuns


def test_an_alone_run_waits_for_the_runs_going_and_holds_new_ones_back() -> None:
    runs, events = ExclusiveRuns(), []
    first_in, first_may_end = threading.Event(), threading.Event()

    def together(name: str, started: threading.Event | None = None,
                 may_end: threading.Event | None = None) -> None:
        with runs.together():
            events.append(f"{name} in")
            if started:
                started.set()
            if may_end:
                may_end.wait(5)
            events.append(f"{name} out")

    def alone() -> None:
        with runs.alone(give_up=lambda: False, poll_s=0.01) as holding:
            assert holding
            events.append("alone in")
            time.sleep(0.05)
            events.append("alone out")

    going = threading.Thread(target=together, args=("first", first_in, first_may_end))
    going.start()
    first_in.wait(5)
    waiting = threading.Thread(target=alone)
    waiting.start()
    time.sleep(0.05)  # the alone run is waiting now
    later = threading.Thread(target=together, args=("later",))
    later.start()
    time.sleep(0.05)
    assert events == ["first in"]  # neither the alone run nor a new one went in beside it
    first_may_end.set()
    for thread in (going, waiting, later):
        thread.join(5)
    assert events == ["first in", "first out", "alone in", "alone out", "later in", "later out"]


def test_an_alone_run_that_gives_up_holds_nothing() -> None:
    runs = ExclusiveRuns()
    with runs.together(), runs.alone(give_up=lambda: True, poll_s=0.01) as holding:
        assert not holding
    with runs.together():  # nothing was left held
        pass

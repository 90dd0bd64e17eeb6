"""The search for the request that crashed an engine step (worker/hosts/crash_isolation.py)."""

from __future__ import annotations

import math

from bulkinfer.worker.hosts.crash_isolation import CrashIsolation


def search(suspects: list[str], culprit: str | None) -> tuple[list[str], list[str], int]:
    """Run the search as the host does, with a step that crashes whenever `culprit` is in the engine;
    returns (failed, finished, crashes)."""
    isolation = CrashIsolation()
    failed, finished, crashes = [], [], 1
    failed += isolation.crashed(suspects)
    while (group := isolation.next_trial()) is not None:
        if culprit in group:
            crashes += 1
            failed += isolation.crashed(group)
            continue
        for request_id in group:
            isolation.finished(request_id)
            finished.append(request_id)
    assert not isolation.active
    return failed, finished, crashes


def test_only_the_request_that_crashes_the_engine_fails_in_about_log2_n_more_crashes() -> None:
    suspects = [f"r{n:02d}" for n in range(40)]
    failed, finished, crashes = search(suspects, culprit="r17")
    assert failed == ["r17"]
    assert sorted(finished) == [s for s in suspects if s != "r17"]
    assert crashes <= 2 + math.ceil(math.log2(len(suspects)))


def test_a_passing_fault_fails_nothing_and_a_lone_request_gets_a_second_chance() -> None:
    assert search([f"r{n}" for n in range(7)], culprit=None)[:2] == ([], sorted(f"r{n}" for n in range(7)))
    assert search(["only"], culprit=None)[:2] == ([], ["only"])
    assert search(["only"], culprit="only") == (["only"], [], 2)  # it crashed the engine twice


def test_an_aborted_suspect_leaves_the_search() -> None:
    isolation = CrashIsolation()
    isolation.crashed(["a", "b", "c", "d"])
    isolation.forget("a")
    isolation.forget("b")
    assert isolation.waiting() == {"c", "d"}
    assert isolation.next_trial() == ["c", "d"]

"""After an engine step crashes: find the request that caused it, and fail only that one.

A step runs every request the scheduler picked, so a crash says only that one of those in the
engine is at fault (a token that breaks a grammar, a prompt that trips a kernel), or none (a
passing fault). The host rebuilds the engine and reruns the suspects in halves, one group at a
time and alone in the engine: a group that finishes clears its requests; a group that crashes
again is split in two; a request that crashes the engine alone (its second crash at least) is the
culprit and becomes an error output. Requests that arrive meanwhile wait until the search ends.
A culprit among n suspects costs about log2(n) more crashes, each an engine rebuild; the others
finish with the same outputs as before (greedy and seeded sampling are deterministic).

Pure bookkeeping over request ids; the host owns the engine (worker/hosts/engine_host.py).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class CrashIsolation:
    def __init__(self) -> None:
        self._groups: deque[list[str]] = deque()  # suspects still to rerun, the next one first
        self._trial: set[str] = set()  # the group in the engine now

    @property
    def active(self) -> bool:
        """True while a search runs: only the trial group may be in the engine."""
        return bool(self._trial or self._groups)

    def crashed(self, in_engine: Iterable[str]) -> list[str]:
        """Record a crash with these requests in the engine; returns the culprits (to fail now):
        a request that crashed it alone while on trial."""
        suspects = sorted(in_engine)
        was_trial = bool(self._trial)
        self._trial = set()
        if was_trial and len(suspects) == 1:
            return suspects
        if len(suspects) == 1:
            self._groups.appendleft(suspects)  # once more, alone: a passing fault clears it
        elif suspects:
            half = len(suspects) // 2
            self._groups.extendleft([suspects[half:], suspects[:half]])
        return []

    def finished(self, request_id: str) -> None:
        self._trial.discard(request_id)

    def forget(self, request_id: str) -> None:
        """An aborted request: no longer a suspect anywhere."""
        self._trial.discard(request_id)
        for group in self._groups:
            if request_id in group:
                group.remove(request_id)
        while self._groups and not self._groups[0]:
            self._groups.popleft()

    def next_trial(self) -> list[str] | None:
        """The group to put in the engine once the current trial is done; None when no group is
        left (the search is over) or the current trial still runs."""
        if self._trial:
            return None
        while self._groups:
            group = self._groups.popleft()
            if group:
                self._trial = set(group)
                return group
        return None

    def waiting(self) -> set[str]:
        """Suspects not in the engine now."""
        return {request_id for group in self._groups for request_id in group}

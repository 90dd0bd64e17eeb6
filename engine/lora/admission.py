"""Which waiting requests may start, so a step never holds more than ``max_loras`` adapters.

Requests are admitted in queue order. A request whose adapter is new to the running set starts
only while fewer than ``max_loras`` adapters run; otherwise it keeps its place and the requests
behind it may still start. So that such a request never starves (rows of the running adapters
arriving forever would keep every slot busy), once one is blocked, one running adapter is chosen
to drain (the one with the fewest running requests, which frees a slot soonest): requests of that
adapter queued behind the blocked one wait, the others go on. When the draining adapter's running
requests end, its slot goes to the oldest blocked request, which is ahead of them in the queue.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Protocol

from bulkinfer.engine.lora.request import LoRARequest


class _HasLoRA(Protocol):
    lora_request: LoRARequest | None


class LoRAAdmission:
    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self.draining: int | None = None  # the adapter id chosen to free a slot, while one is blocked
        self._running = Counter[int]()
        self._blocked = False

    def begin(self, running: Iterable[_HasLoRA]) -> None:
        """Start a step's admissions, given the requests running now."""
        self._running = Counter(r.lora_request.lora_int_id for r in running if r.lora_request is not None)
        self._blocked = False
        if self.draining not in self._running:
            self.draining = None  # drained: its slot is free for the blocked request

    def admits(self, request: _HasLoRA) -> bool:
        if request.lora_request is None:
            return True
        lora_id = request.lora_request.lora_int_id
        if lora_id in self._running:
            return not (self._blocked and lora_id == self.draining)
        if len(self._running) < self.max_loras:
            return True
        self._blocked = True
        if self.draining is None:
            self.draining = min(self._running, key=lambda i: (self._running[i], i))
        return False

    def admitted(self, request: _HasLoRA) -> None:
        if request.lora_request is not None:
            self._running[request.lora_request.lora_int_id] += 1

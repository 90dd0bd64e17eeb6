"""Which adapter slot each row of a step uses, as runs of consecutive rows.

The model runner orders a step's rows by adapter (within the decode rows and within the prefill
rows: engine/model_runner.py), so each adapter's rows are one or two contiguous runs and every
projection applies an update to a slice of its output: no gather, no scatter. Set for a step that
has LoRA rows (None otherwise: every projection then skips LoRA at the cost of one check).
"""

from __future__ import annotations

import torch

NO_ADAPTER = -1


class LoRARows:
    def __init__(self, slots: torch.Tensor) -> None:
        self.slots = slots  # [rows] int64: an adapter slot, or NO_ADAPTER
        self._runs: list[tuple[int, slice]] | None = None
        self._batched: tuple[slice, int, int, int] | None | bool = False  # False: not worked out yet
        self._tails: dict[int, LoRARows] = {}

    @property
    def num_rows(self) -> int:
        return int(self.slots.shape[0])

    def groups(self) -> list[tuple[int, slice]]:
        """(slot, rows) for each run of consecutive rows with the same adapter (base rows left out)."""
        if self._runs is None:
            cpu_slots = self.slots.cpu()
            if not len(cpu_slots):
                return []
            starts = [0, *(torch.nonzero(cpu_slots[1:] != cpu_slots[:-1]).squeeze(1) + 1).tolist()]
            ends = [*starts[1:], len(cpu_slots)]
            values = cpu_slots[starts].tolist()
            self._runs = [(slot, slice(start, end))
                          for slot, start, end in zip(values, starts, ends, strict=True)
                          if slot != NO_ADAPTER]
        return self._runs

    def batched(self) -> tuple[slice, int, int, int] | None:
        """(rows, number of runs, rows per run, first slot) where the runs are adjacent, of one
        length, and of consecutive slots (a decode step of adapters mixed evenly): the updates are
        then two batched matmuls over views, instead of two matmuls per run. None otherwise."""
        if self._batched is False:
            runs = self.groups()
            self._batched = None
            if len(runs) > 1:
                length = runs[0][1].stop - runs[0][1].start
                first_slot, start = runs[0][0], runs[0][1].start
                if all(slot == first_slot + i and run.start == start + i * length
                       and run.stop - run.start == length for i, (slot, run) in enumerate(runs)):
                    self._batched = (slice(start, start + len(runs) * length), len(runs), length, first_slot)
        return self._batched  # type: ignore[return-value]

    def after(self, start: int) -> LoRARows:
        """The rows from ``start`` on (a step's prefill rows, after its single-token ones), kept for
        the step's other projections."""
        tail = self._tails.get(start)
        if tail is None:
            tail = self._tails[start] = LoRARows(self.slots[start:])
        return tail

    def select(self, rows: torch.Tensor) -> LoRARows:
        """The same for a subset of the rows in their order (the last layer's kept rows)."""
        return LoRARows(self.slots.index_select(0, rows.to(self.slots.device)))

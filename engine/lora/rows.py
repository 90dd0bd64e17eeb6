"""Which adapter slot each row of a step uses, grouped for the projections.

Set by the model runner for a step that has LoRA rows (None otherwise, and every projection
skips LoRA at the cost of one attribute check). Every projection of the step reuses the groups.
"""

from __future__ import annotations

import torch

NO_ADAPTER = -1


class LoRARows:
    def __init__(self, slots: torch.Tensor) -> None:
        self.slots = slots  # [rows] int64: an adapter slot, or NO_ADAPTER
        self._groups: list[tuple[int, slice | torch.Tensor]] | None = None

    @property
    def num_rows(self) -> int:
        return int(self.slots.shape[0])

    def groups(self) -> list[tuple[int, slice | torch.Tensor]]:
        """(slot, rows) per adapter present: a slice where its rows are contiguous (no gather, no
        scatter), else their indices."""
        if self._groups is None:
            cpu_slots = self.slots.cpu()
            groups: list[tuple[int, slice | torch.Tensor]] = []
            for slot in torch.unique(cpu_slots).tolist():
                if slot == NO_ADAPTER:
                    continue
                index = torch.nonzero(cpu_slots == slot).squeeze(1)
                first, last = int(index[0]), int(index[-1])
                if last - first + 1 == len(index):
                    groups.append((slot, slice(first, last + 1)))
                else:
                    groups.append((slot, index.to(self.slots.device)))
            self._groups = groups
        return self._groups

    def select(self, rows: torch.Tensor) -> LoRARows:
        """The same for a subset of the rows (the last layer's kept rows)."""
        return LoRARows(self.slots.index_select(0, rows.to(self.slots.device)))

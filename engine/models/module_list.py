"""`ModuleSeq[T]`: an `nn.ModuleList` whose items a type checker knows.

`for layer in model.layers` gives `nn.Module` to a type checker, so every `layer.self_attn` reads as
`Tensor | Module` (nn.Module's `__getattr__`). At run time this is a plain ModuleList (the same
checkpoint names, the same modules); the typed `__iter__` and `__getitem__` exist only for checkers.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Generic, TypeVar, overload

from torch import nn

M = TypeVar("M", bound=nn.Module)


class ModuleSeq(nn.ModuleList, Generic[M]):
    if TYPE_CHECKING:

        def __iter__(self) -> Iterator[M]: ...

        @overload  # type: ignore[override]
        def __getitem__(self, index: int) -> M: ...

        @overload
        def __getitem__(self, index: slice) -> ModuleSeq[M]: ...

        def __getitem__(self, index: int | slice) -> M | ModuleSeq[M]: ...

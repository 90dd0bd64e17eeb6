"""Parsing a GGUF file quickly, and once for a whole import.

`gguf.GGUFReader` decodes every metadata element with its own slice of the file's memory map
(SmolLM2's 49k-token vocabulary and 48k merges: ~400k slices), and a slice of an `np.memmap` runs
Python code (`memmap.__getitem__`, `__array_finalize__`) where a slice of a plain array does not:
`reader_class()` reads through a plain array view of the same map, 2-4x faster, with the same fields
and tensors. And `transformers` builds a fresh reader for the tokenizer, for the config and for the
weights, and the same tensor-name map once per module of the model (~400 times): within
`parsed_once`, every reader asked for the file is the one already parsed, and each name map is built once.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


@functools.cache
def reader_class() -> type:
    """A `gguf.GGUFReader` whose `data` (its memory map) is held as a plain `np.ndarray` view."""
    import numpy as np
    from gguf import GGUFReader

    class ArrayBackedReader(GGUFReader):
        @property  # type: ignore[override]
        def data(self) -> Any:
            return self._array

        @data.setter
        def data(self, value: Any) -> None:
            self._array = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    return ArrayBackedReader


@contextmanager
def parsed_once(path: Path, reader: Any) -> Iterator[None]:
    """While inside, `gguf.GGUFReader(path)` gives `reader` (already parsed) and
    `gguf.get_tensor_name_map` remembers its maps. transformers imports both from `gguf` at call time,
    so replacing the module's attributes reaches it; they are put back on exit."""
    import gguf

    original_reader: Callable[..., Any] = gguf.GGUFReader
    original_name_map: Callable[..., Any] = gguf.get_tensor_name_map
    wanted = os.path.realpath(path)

    def reader_for(file: Any, mode: str = "r") -> Any:
        if mode == "r" and os.path.realpath(os.fspath(file)) == wanted:
            return reader
        return original_reader(file, mode)

    setattr(gguf, "GGUFReader", reader_for)  # noqa: B010 - a module attribute, replaced for a while
    setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(original_name_map))  # noqa: B010
    try:
        yield
    finally:
        setattr(gguf, "GGUFReader", original_reader)  # noqa: B010
        setattr(gguf, "get_tensor_name_map", original_name_map)  # noqa: B010

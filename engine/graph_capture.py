"""Capturing a fixed-shape forward as CUDA graphs, one per shape, on first use: what the decode and
mixed-step graphs (decode_graphs.py, mixed_graphs.py) share.

A graph replays a whole forward's kernels in one launch, but only a forward whose work is fixed:
the same shapes and addresses every time and no host reads in between. Each subclass pads a step to
a shape (its key), copies the step's inputs into buffers its forward reads, and runs `_forward(*key)`
on those buffers: uncaptured on a CPU (where the tests check the fixed-shape path), captured on a
GPU. All graphs share one memory pool (one replays at a time; its output is copied out before the
next replay overwrites it)."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Hashable
from typing import Any

import torch

logger = logging.getLogger(__name__)


class FixedShapeGraphs(ABC):
    """The graphs of `_forward` (a subclass's), one per key, with what failed to capture."""

    what = "a step"  # for the log: which steps these graphs run
    # A failed capture raises instead of leaving its steps eager: under tensor parallel every rank
    # must run the same padded shapes, or their collectives stop pairing up.
    strict = False

    def __init__(self, capture: bool) -> None:
        self.capture = capture
        self.graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool: Any = None  # the first graph's memory pool: the others share it
        self.failed: set[Hashable] = set()  # shapes whose capture ran out of memory
        self.broken = False  # a capture failed otherwise: every step runs eagerly from then on

    @abstractmethod
    def _forward(self, *key: int) -> torch.Tensor:
        """The forward of one padded shape, from the buffers."""

    @abstractmethod
    def _device(self) -> torch.device:
        """The device the buffers (and the graphs) are on."""

    def _replay(self, key: tuple[int, ...]) -> torch.Tensor | None:
        """The forward's output for `key`: run eagerly where nothing is captured, else its graph
        replayed (captured first where needed); None where its capture failed (run eagerly then)."""
        if not self.capture:
            return self._forward(*key)
        entry = self.graphs.get(key) or self._capture(key)
        if entry is None:
            return None
        graph, output = entry
        with torch.cuda.device(output.device):  # replays on that device's current stream
            graph.replay()
        return output

    def _capture(self, key: tuple[int, ...]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor] | None:
        """The graph of this shape and its output buffer, recorded now; None where recording failed
        (that shape, or every shape, then runs eagerly: the engine keeps serving)."""
        try:
            graph, output = self._record(*key)
        except torch.cuda.OutOfMemoryError:
            if self.strict:
                raise
            logger.warning("no GPU memory to capture %s of shape %s: it runs eagerly", self.what, key)
            self.failed.add(key)
            torch.cuda.empty_cache()
            return None
        except RuntimeError:
            if self.strict:
                raise
            # An op the capture cannot record (a bug: the forward must not read the device from the
            # host): the engine keeps serving, eagerly, and says so once.
            logger.exception("capturing %s as a CUDA graph failed: those steps run eagerly", self.what)
            self.broken = True
            return None
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[key] = (graph, output)
        logger.debug("captured %s of shape %s (%d graphs)", self.what, key, len(self.graphs))
        return graph, output

    def _record(self, *key: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Capture the forward of this shape, after one eager run on a side stream (lazy
        initialisations stay out of the graph). The run writes the step's K/V, which the replay
        writes again, the same values."""
        device = self._device()
        with torch.cuda.device(device):  # the engine's GPU, whichever is current
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                self._forward(*key)
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: other threads of the worker (uploads, grammar compiles) stay free to run
            # while this one captures
            with torch.cuda.graph(graph, pool=self.pool, stream=side, capture_error_mode="thread_local"):
                output = self._forward(*key)
        return graph, output

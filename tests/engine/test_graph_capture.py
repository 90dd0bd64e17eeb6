"""What a failed capture does (engine/graph_capture.py): one engine keeps serving those steps
eagerly; under tensor parallel (`strict`) it raises, since a rank left eager would run other
shapes than the others and their collectives would stop pairing up."""

from __future__ import annotations

import pytest
import torch

from bulkinfer.engine.graph_capture import FixedShapeGraphs


class FailingGraphs(FixedShapeGraphs):
    def __init__(self, error: Exception) -> None:
        super().__init__(capture=True)
        self.error = error

    def _forward(self, *key: int) -> torch.Tensor:
        return torch.zeros(key)

    def _device(self) -> torch.device:
        return torch.device("cpu")

    def _record(self, *key: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        raise self.error


@pytest.mark.parametrize("error", [torch.cuda.OutOfMemoryError("no memory"),
                                   RuntimeError("op not capturable")])
def test_a_failed_capture_leaves_steps_eager_on_one_rank_and_raises_under_tensor_parallel(error) -> None:
    graphs = FailingGraphs(error)
    assert graphs._replay((2,)) is None  # the caller runs this step eagerly
    out_of_memory = isinstance(error, torch.cuda.OutOfMemoryError)
    assert (graphs.failed == {(2,)}, graphs.broken) == (out_of_memory, not out_of_memory)
    strict = FailingGraphs(error)
    strict.strict = True
    with pytest.raises(type(error)):
        strict._replay((2,))
